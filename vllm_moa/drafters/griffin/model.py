"""The GRIFFIN drafter: EAGLE's `fc` fusion refined by Token-Guided Fusion, EAGLE's decoder
layer with a Token-Enhanced Head."""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from vllm_moa.drafters.eagle.model import EagleDrafter
from vllm_moa.drafters.griffin.config import GriffinConfig
from vllm_moa.drafters.token_layers import TokenLayerConfig
from vllm_moa.model.layers import Attend, DecoderBlock, RMSNorm


class TokenGuidedFusion(nn.Module):
    """The paper's TGF steps 2-3 (its Eqs. for z and o): o = SiLU([N(h) | N(x)] W_u + b_u) W_d
    + b_d + h, where h is `fc`'s fusion of feature and token (step 1) and x the token's
    embedding, used a second time. RMSNorms as everywhere in the drafter (the paper says layer
    norm; the released code uses RMSNorm), one per stream."""

    def __init__(self, width: int, intermediate: int, eps: float) -> None:
        super().__init__()
        self.fused_norm = RMSNorm(width, eps)
        self.token_norm = RMSNorm(width, eps)
        self.up_proj = nn.Linear(2 * width, intermediate, bias=True)
        self.down_proj = nn.Linear(intermediate, width, bias=True)

    def forward(self, fused: torch.Tensor, token_embeds: torch.Tensor) -> torch.Tensor:
        """fused h, token embeddings x: [..., E] -> o [..., E]."""
        z = self.up_proj(torch.cat([self.fused_norm(fused), self.token_norm(token_embeds)], -1))
        return fused + self.down_proj(F.silu(z))


class TokenEnhancedBlock(DecoderBlock):
    """EAGLE's decoder layer (no input norm) whose MLP writes 2E values on a doubled residual:
    [h | h] + MLP(norm(h)). The first E predict the token (the LM head reads them), the last E
    regress the next feature (the next step's input, and the feature loss's prediction): the
    paper's Token-Enhanced Head, which decouples the two objectives."""

    def forward(
        self,
        x: torch.Tensor,  # [B, T, E]
        positions: torch.Tensor,  # [T], or [B, T] per row
        k: torch.Tensor,  # [B, Hkv, S, D]
        v: torch.Tensor,  # [B, Hkv, S, D]
        mask: torch.Tensor | None,  # bool [T, S] or [B, 1, T, S]
    ) -> torch.Tensor:
        """-> [B, T, 2E]."""
        x = x + self.self_attn(self.input_layernorm(x), positions, k, v, mask)
        return torch.cat([x, x], dim=-1) + self.mlp(self.post_attention_layernorm(x))

    def step(
        self, x: torch.Tensor, positions: torch.Tensor, attend: Attend, self_kv: bool = True
    ) -> torch.Tensor:
        raise NotImplementedError("GRIFFIN drafts through TokenEnhancedBlock.forward")


class GriffinDrafter(EagleDrafter):
    FC_BIAS: ClassVar[bool] = True  # the paper's b_m

    def __init__(self, config: GriffinConfig) -> None:
        super().__init__(config)
        self.config: GriffinConfig = config
        e = config.target_hidden_size
        self.tgf = TokenGuidedFusion(e, config.tgf_intermediate_size, config.rms_norm_eps)

    @staticmethod
    def make_layer(config: TokenLayerConfig) -> DecoderBlock:
        c = config
        return TokenEnhancedBlock(
            c.target_hidden_size,
            c.num_heads,
            c.num_kv_heads,
            c.intermediate_size,
            c.rope_theta,
            c.rms_norm_eps,
            input_norm=False,
            mlp_out_width=2 * c.target_hidden_size,
            rope_scaling=c.rope_scaling,
        )

    def fuse(self, next_embeds: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """TGF: h = fc([x | f]) (step 1), then refined with x again (steps 2-3)."""
        return self.tgf(super().fuse(next_embeds, features), next_embeds)

    def heads(self, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[..., 2E] -> (the token-prediction state, the regressed feature), each [..., E]."""
        e = self.config.target_hidden_size
        return out[..., :e], out[..., e:]
