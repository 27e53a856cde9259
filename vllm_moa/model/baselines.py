"""The independent drafter, a baseline trained in the same framework as MoA (MOA_SPEC
"Baselines"): a small causal LM over the target's token embeddings with a final norm, read by the
target's LM head; it never sees target activations.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, cast

import torch
from torch import nn

from vllm_moa.drafters.token_layers import TokenLayerConfig, random_init
from vllm_moa.model.layers import DecoderBlock, RMSNorm
from vllm_moa.model.masks import causal_mask


@dataclass(frozen=True)
class IndependentConfig(TokenLayerConfig):
    MODEL_TYPE: ClassVar[str] = "independent_drafter"
    ARCHITECTURE: ClassVar[str] = "IndependentDrafter"

    num_layers: int = 2


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
        random_init(self, seed, std)

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
