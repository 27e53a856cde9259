"""The EAGLE drafter: `fc` fuses a token's embedding with a target feature, one causal decoder
layer predicts the next feature."""

from __future__ import annotations

import torch
from torch import nn

from vllm_moa.drafters.eagle.config import EagleConfig
from vllm_moa.drafters.token_layers import random_init
from vllm_moa.model.layers import DecoderBlock
from vllm_moa.model.masks import causal_mask


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
        random_init(self, seed, std)

    def fuse(self, next_embeds: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """[B, T, E] embeddings of x_{i+1} and [B, T, E] features f_i -> layer input [B, T, E]."""
        return self.fc(torch.cat([next_embeds, features], dim=-1))

    def forward(self, next_embeds: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """Full-sequence forward: input i = (x_{i+1}, f_i) -> predicted f_{i+1}, [B, T, E]."""
        x = self.fuse(next_embeds, features)
        positions = torch.arange(x.shape[1], device=x.device)
        k, v = self.layer.kv_from(x, positions)
        return self.layer(x, positions, k, v, causal_mask(positions, x.shape[1]))
