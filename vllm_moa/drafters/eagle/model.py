"""The EAGLE drafter: `fc` fuses a token's embedding with a target feature, one causal decoder
layer predicts the next feature."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import ClassVar

import torch
from torch import nn

from vllm_moa.drafters.token_layers import TokenLayerConfig, random_init
from vllm_moa.model.layers import DecoderBlock
from vllm_moa.model.masks import aligned_pass_mask, causal_mask


class EagleDrafter(nn.Module):
    """Subclasses change the fusion (`fuse`), the layer (`make_layer`), what the layer's output
    holds (`heads`; GRIFFIN), which target states the drafter reads (`feature_layers`,
    `target_features`) and the LM head (`logits`; EAGLE-3); the forward, the proposer and the
    training method are written against these."""

    FC_BIAS: ClassVar[bool] = False  # EAGLE-1's fc has none (vLLM's EAGLE loader neither)
    # Whether token-aligned training passes a pass's predicted features to the next one
    # detached (HASS, GRIFFIN) or with their gradient (EAGLE-3's training-time test).
    DETACH_FED: ClassVar[bool] = True

    def __init__(self, config: TokenLayerConfig) -> None:
        super().__init__()
        self.config = config
        e = config.target_hidden_size
        self.fc = nn.Linear(self.fc_inputs(config) * e, e, bias=self.FC_BIAS)
        self.layer = self.make_layer(config)

    @staticmethod
    def fc_inputs(config: TokenLayerConfig) -> int:
        """How many E-wide vectors `fc` reads: EAGLE's [token embedding | feature]."""
        return 2

    def feature_layers(self) -> tuple[int, ...]:
        """The target hidden states (HF indexing: l < L the input of layer l, L the final,
        normalised state) the drafter reads at verified positions. EAGLE: the final one."""
        return (self.config.target_num_layers,)

    def target_features(self, hidden_states: Mapping[int, torch.Tensor]) -> torch.Tensor:
        """The target's states at verified positions ({layer: [..., T, E]}, `feature_layers`)
        -> the features f the layer input fuses, [..., T, E]. EAGLE: the final state as is."""
        return hidden_states[self.config.target_num_layers]

    def logits(
        self, states: torch.Tensor, target_head: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        """The next-token logits over the target's vocabulary [..., V] of the states the LM
        head reads (`heads`' first). EAGLE: the target's LM head, without a final norm."""
        return target_head(states)

    @staticmethod
    def make_layer(config: TokenLayerConfig) -> DecoderBlock:
        c = config
        return DecoderBlock(
            c.target_hidden_size,
            c.num_heads,
            c.num_kv_heads,
            c.intermediate_size,
            c.rope_theta,
            c.rms_norm_eps,
            input_norm=False,
            rope_scaling=c.rope_scaling,
        )

    def init_weights(self, seed: int, std: float = 0.02, norm_init: str = "ones") -> None:
        random_init(self, seed, std, norm_init)

    def fuse(self, next_embeds: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """[B, T, E] embeddings of x_{i+1} and [B, T, E] features f_i -> layer input [B, T, E]."""
        return self.fc(torch.cat([next_embeds, features], dim=-1))

    def heads(self, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's output [..., W] -> (the state the LM head reads, the feature the next
        draft step reads), each [..., E]. EAGLE: both are the output, the predicted f_{i+1}."""
        return out, out

    def forward(
        self, next_embeds: torch.Tensor, features: torch.Tensor, passes: int = 1
    ) -> torch.Tensor:
        """Full-sequence forward: input i = (x_{i+1}, f_i) -> the layer's output at i, [B, T, W]
        (EAGLE: the predicted f_{i+1}, W = E).

        passes > 1: token-aligned training (HASS, GRIFFIN). Pass j (0-based) feeds input i the
        feature pass j-1 predicted at i-1 (detached; input 0 keeps f_0), so its output at i is
        the (j+1)-th draft of a cycle whose first draft came from input i - j: its query sees
        the true-feature keys of pass 0 before that cycle and, inside it, the key each earlier
        pass computed there (`aligned_pass_mask`). Returns [passes * B, T, W], pass j in rows
        j*B..(j+1)*B-1 (one call, so data-parallel training syncs every pass's gradients)."""
        seq = next_embeds.shape[1]
        positions = torch.arange(seq, device=next_embeds.device)
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        outs = []
        inputs = features
        for j in range(passes):
            x = self.fuse(next_embeds, inputs)
            k, v = self.layer.kv_from(x, positions)
            keys.append(k)
            values.append(v)
            if j == 0:
                out = self.layer(x, positions, k, v, causal_mask(positions, seq))
            else:
                mask = aligned_pass_mask(j, seq, x.device)
                out = self.layer(x, positions, torch.cat(keys, 2), torch.cat(values, 2), mask)
            outs.append(out)
            if j + 1 < passes:
                fed = self.heads(out)[1]
                fed = fed.detach() if self.DETACH_FED else fed
                inputs = torch.cat([features[:, :1], fed[:, :-1].to(features.dtype)], dim=1)
        return outs[0] if passes == 1 else torch.cat(outs, dim=0)
