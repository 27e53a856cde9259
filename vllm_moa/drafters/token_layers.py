"""What the token-layer baselines (EAGLE, GRIFFIN, EAGLE-3, independent) are made of: decoder
layers at the target's width over tokens. Their config base and their weight initialisation."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from vllm_moa.model.config import DrafterConfig, TargetShape
from vllm_moa.model.rope import scaled_frequencies


@dataclass(frozen=True)
class TokenLayerConfig(DrafterConfig):
    """Decoder layer(s) at the target's width over tokens: what the baselines are made of."""

    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    # The target's RoPE scaling, applied in every attention of the drafter (as the EAGLE-3
    # authors' cnets.py and vLLM's llama_eagle3.py do): model/rope.py's rope_scaling_of form,
    # e.g. {"rope_type": "llama3", "factor": 8.0, ...}. None: plain RoPE (every drafter made
    # before this field existed).
    rope_scaling: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        self._check_numbers()
        self._check_heads("", self.target_hidden_size, self.num_heads, self.num_kv_heads)
        if self.rope_scaling is not None:  # transformers validates the parameters
            head = self.target_hidden_size // self.num_heads
            what = f"{type(self).__name__}.rope_scaling"
            scaled_frequencies(head, self.rope_theta, self.rope_scaling, what)

    @property
    def target_shape(self) -> TargetShape:
        return dataclasses.replace(super().target_shape, rope_scaling=self.rope_scaling)


def random_init(module: nn.Module, seed: int, std: float, norm_init: str = "ones") -> None:
    """Deterministic random initialisation: normal(0, std) matrices, zero bias, and RMSNorm
    weights of ones or (`norm_init="normal"`, as the MoA authors' code) normal(0, std), drawn
    from a generator of their own so that the other weights are those of "ones"."""
    if norm_init not in ("ones", "normal"):
        raise ValueError(f"norm_init must be 'ones' or 'normal', got {norm_init!r}")
    gen = torch.Generator().manual_seed(seed)
    norms = torch.Generator().manual_seed(seed + 1_000_003)
    with torch.no_grad():
        for name, p in sorted(module.named_parameters()):
            if name.endswith(("layernorm.weight", "norm.weight")):
                if norm_init == "ones":
                    p.fill_(1.0)
                else:
                    p.copy_(torch.randn(p.shape, generator=norms) * std)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
