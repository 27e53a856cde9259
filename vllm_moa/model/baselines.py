"""Baseline drafters trained in the same framework as MoA (MOA_SPEC "Baselines").

EAGLE: at position i the input is [token_embed(x_{i+1}) | f_i] (f = the target's final,
normalised hidden state), projected by `fc` (2E -> E, no bias) and passed through one causal
decoder layer without input norm (EAGLE-1's layout, the one vLLM's `EagleLlamaForCausalLM`
loads: `vllm-moa export-eagle`); the output predicts f_{i+1}, read by the target's LM head
without a final norm. 1-step bounded, TLI = 0.
Independent: a small causal LM over the target's token embeddings with a final norm, read by the
target's LM head; it never sees target activations.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, cast

import torch
from torch import nn

from vllm_moa.model.config import DrafterConfig
from vllm_moa.model.layers import DecoderBlock, RMSNorm
from vllm_moa.model.masks import causal_mask


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


@dataclass(frozen=True)
class EagleConfig(TokenLayerConfig):
    MODEL_TYPE: ClassVar[str] = "eagle_drafter"
    ARCHITECTURE: ClassVar[str] = "EagleDrafter"


@dataclass(frozen=True)
class IndependentConfig(TokenLayerConfig):
    MODEL_TYPE: ClassVar[str] = "independent_drafter"
    ARCHITECTURE: ClassVar[str] = "IndependentDrafter"

    num_layers: int = 2


def _init(module: nn.Module, seed: int, std: float) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(module.named_parameters()):
            if name.endswith(("layernorm.weight", "norm.weight")):
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * std)


class EagleDrafter(nn.Module):
    def __init__(self, config: EagleConfig) -> None:
        super().__init__()
        self.config = config
        c, e = config, config.target_hidden_size
        self.fc = nn.Linear(2 * e, e, bias=False)
        self.layer = DecoderBlock(
            e,
            c.num_heads,
            c.num_kv_heads,
            c.intermediate_size,
            c.rope_theta,
            c.rms_norm_eps,
            input_norm=False,
        )

    def init_weights(self, seed: int, std: float = 0.02) -> None:
        _init(self, seed, std)

    def fuse(self, next_embeds: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """[B, T, E] embeddings of x_{i+1} and [B, T, E] features f_i -> layer input [B, T, E]."""
        return self.fc(torch.cat([next_embeds, features], dim=-1))

    def forward(self, next_embeds: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """Full-sequence forward: input i = (x_{i+1}, f_i) -> predicted f_{i+1}, [B, T, E]."""
        x = self.fuse(next_embeds, features)
        positions = torch.arange(x.shape[1], device=x.device)
        k, v = self.layer.kv_from(x, positions)
        return self.layer(x, positions, k, v, causal_mask(positions, x.shape[1]))


class IndependentDrafter(nn.Module):
    def __init__(self, config: IndependentConfig) -> None:
        super().__init__()
        self.config = config
        c, e = config, config.target_hidden_size
        self.layers = nn.ModuleList(
            DecoderBlock(
                e, c.num_heads, c.num_kv_heads, c.intermediate_size, c.rope_theta, c.rms_norm_eps
            )
            for _ in range(c.num_layers)
        )
        self.norm = RMSNorm(e, c.rms_norm_eps)

    def init_weights(self, seed: int, std: float = 0.02) -> None:
        _init(self, seed, std)

    @property
    def blocks(self) -> list[DecoderBlock]:
        return [cast(DecoderBlock, m) for m in self.layers]

    def forward(self, embeds: torch.Tensor) -> torch.Tensor:
        """Full-sequence forward over token embeddings [B, T, E] -> final hidden [B, T, E]."""
        positions = torch.arange(embeds.shape[1], device=embeds.device)
        mask = causal_mask(positions, embeds.shape[1])
        h = embeds
        for layer in self.blocks:
            k, v = layer.kv_from(h, positions)
            h = layer(h, positions, k, v, mask)
        return self.norm(h)
