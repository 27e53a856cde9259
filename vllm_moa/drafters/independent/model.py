"""The independent drafter: `num_layers` causal decoder layers over the target's token
embeddings with a final norm."""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from vllm_moa.drafters.independent.config import IndependentConfig
from vllm_moa.drafters.token_layers import random_init
from vllm_moa.model.layers import DecoderBlock, RMSNorm
from vllm_moa.model.masks import causal_mask


class IndependentDrafter(nn.Module):
    def __init__(self, config: IndependentConfig) -> None:
        super().__init__()
        self.config = config
        c, e = config, config.target_hidden_size
        self.layers = nn.ModuleList(
            DecoderBlock(
                e,
                c.num_heads,
                c.num_kv_heads,
                c.intermediate_size,
                c.rope_theta,
                c.rms_norm_eps,
                rope_scaling=c.rope_scaling,
            )
            for _ in range(c.num_layers)
        )
        self.norm = RMSNorm(e, c.rms_norm_eps)

    def init_weights(self, seed: int, std: float = 0.02, norm_init: str = "ones") -> None:
        random_init(self, seed, std, norm_init)

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
