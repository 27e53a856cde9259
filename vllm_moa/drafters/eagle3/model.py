"""The EAGLE-3 drafter: `fc` projects three target states into the feature; one decoder layer
whose attention reads [norm(embedding) | norm(feature)]; a final norm and its own LM head."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import ClassVar

import torch
from torch import nn

from vllm_moa.drafters.eagle.model import EagleDrafter
from vllm_moa.drafters.eagle3.config import Eagle3Config
from vllm_moa.drafters.token_layers import TokenLayerConfig
from vllm_moa.model.layers import Attend, Attention, DecoderBlock, RMSNorm


class Eagle3Block(DecoderBlock):
    """EAGLE-3's decoder layer. Its input x is [e | h] (2E): e the token's embedding, h the
    feature (fc's projection of the target's states, or the previous draft step's output). The
    attention reads [input_layernorm(e) | hidden_norm(h)] (q, k and v project 2E -> heads);
    the residual is h itself, un-normalised; the output (E) is before any final norm:

        h' = h + Attn([N_in(e) | N_h(h)]);  out = h' + MLP(N_post(h'))

    as the authors' `LlamaDecoderLayeremb` and vLLM's `LlamaDecoderLayer` of llama_eagle3.py
    (with norm_before_residual false, its default) compute."""

    def __init__(self, config: TokenLayerConfig) -> None:
        c, e = config, config.target_hidden_size
        heads, kv_heads, eps = c.num_heads, c.num_kv_heads, c.rms_norm_eps
        super().__init__(e, heads, kv_heads, c.intermediate_size, c.rope_theta, eps)
        self.hidden_norm = RMSNorm(e, eps)
        self.self_attn = Attention(e, heads, kv_heads, c.rope_theta, in_width=2 * e)
        self.width = e

    def _attention_input(self, x: torch.Tensor) -> torch.Tensor:
        e = self.width
        return torch.cat([self.input_layernorm(x[..., :e]), self.hidden_norm(x[..., e:])], -1)

    def kv_from(
        self, source: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """source: [B, S, 2E] -> k, v: [B, Hkv, S, D]."""
        return self.self_attn.project_kv(self._attention_input(source), positions)

    def forward(
        self,
        x: torch.Tensor,  # [B, T, 2E]
        positions: torch.Tensor,  # [T], or [B, T] per row
        k: torch.Tensor,  # [B, Hkv, S, D]
        v: torch.Tensor,  # [B, Hkv, S, D]
        mask: torch.Tensor | None,  # bool [T, S] or [B, 1, T, S]
    ) -> torch.Tensor:
        """-> [B, T, E]."""
        h = x[..., self.width :]
        h = h + self.self_attn(self._attention_input(x), positions, k, v, mask)
        return h + self.mlp(self.post_attention_layernorm(h))

    def step(
        self, x: torch.Tensor, positions: torch.Tensor, attend: Attend, self_kv: bool = True
    ) -> torch.Tensor:
        raise NotImplementedError("EAGLE-3 drafts through Eagle3Block.forward")


class Eagle3Drafter(EagleDrafter):
    # EAGLE-3 trains through its unrolled passes (the training-time test).
    DETACH_FED: ClassVar[bool] = False

    def __init__(self, config: Eagle3Config) -> None:
        super().__init__(config)
        self.config: Eagle3Config = config
        e = config.target_hidden_size
        self.norm = RMSNorm(e, config.rms_norm_eps)
        self.lm_head = nn.Linear(e, config.draft_vocab_size, bias=False)

    def init_head_from(self, norm_weight: torch.Tensor, lm_head_weight: torch.Tensor) -> None:
        """Start the final norm and LM head from the target's (copies; both then train):
        `vllm-moa train --head-init target`. The authors' code starts them from random."""
        if lm_head_weight.shape != self.lm_head.weight.shape:
            raise ValueError(
                f"the target's LM head is {tuple(lm_head_weight.shape)}, this drafter's "
                f"{tuple(self.lm_head.weight.shape)}: --head-init target needs the full vocabulary"
            )
        with torch.no_grad():
            self.norm.weight.copy_(norm_weight.to(self.norm.weight.dtype))
            self.lm_head.weight.copy_(lm_head_weight.to(self.lm_head.weight.dtype))

    @staticmethod
    def fc_inputs(config: TokenLayerConfig) -> int:
        """fc reads the target's states of the feature layers, concatenated (3 by default)."""
        assert isinstance(config, Eagle3Config)
        return len(config.feature_layers)

    @staticmethod
    def make_layer(config: TokenLayerConfig) -> DecoderBlock:
        return Eagle3Block(config)

    def feature_layers(self) -> tuple[int, ...]:
        return self.config.feature_layers

    def target_features(self, hidden_states: Mapping[int, torch.Tensor]) -> torch.Tensor:
        """fc([s_low | s_mid | s_high]): the inputs of the feature layers, ascending (as vLLM and
        the authors concatenate them), -> [..., T, E]."""
        dtype = self.fc.weight.dtype
        states = [hidden_states[layer].to(dtype) for layer in self.feature_layers()]
        return self.fc(torch.cat(states, dim=-1))

    def fuse(self, next_embeds: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """[e | h], 2E: Eagle3Block normalises each half and keeps h as its residual."""
        return torch.cat([next_embeds, features.to(next_embeds.dtype)], dim=-1)

    def logits(
        self, states: torch.Tensor, target_head: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        """EAGLE-3's own LM head after its final norm (the target's head is not used)."""
        return self.lm_head(self.norm(states.to(self.fc.weight.dtype)))
