"""What both baselines (EAGLE, independent) are made of: decoder layers at the target's width
over tokens. Their config base and their weight initialisation."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from vllm_moa.model.config import DrafterConfig


@dataclass(frozen=True)
class TokenLayerConfig(DrafterConfig):
    """Decoder layer(s) at the target's width over tokens: what both baselines are made of."""

    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        self._check_numbers()
        self._check_heads("", self.target_hidden_size, self.num_heads, self.num_kv_heads)


def random_init(module: nn.Module, seed: int, std: float) -> None:
    """Deterministic random initialisation: normal(0, std) matrices, unit norms, zero bias."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(module.named_parameters()):
            if name.endswith(("layernorm.weight", "norm.weight")):
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
