"""EAGLE's training forward, 1-step bounded (unrolled when evaluation asks for stale steps)."""

from __future__ import annotations

import torch

from vllm_moa.drafters.eagle.model import EagleDrafter
from vllm_moa.hf_target.adapter import HFTarget, TargetOutput
from vllm_moa.training.data import Batch
from vllm_moa.training.methods import DraftForward, Method


class EagleMethod(Method[EagleDrafter]):
    """EAGLE: input m = (x_{m+1}, f_m + noise) predicts f_{m+1}. Trained 1-step bounded (true
    features everywhere). When memory limits ask for stale steps (evaluation), the forward is
    unrolled so every query sees what it sees at inference: keys of earlier cycles computed from
    true features, keys of its own cycle from the features it predicted."""

    k_bounded = False

    def __init__(self, drafter: EagleDrafter, target: HFTarget, feature_noise: float = 0.0) -> None:
        super().__init__(drafter, target, feature_noise)
        self.hidden_layers: tuple[int, ...] = (target.shape.num_layers,)

    def forward(
        self,
        batch: Batch,
        target_out: TargetOutput,
        memory_limit: torch.Tensor,
        sa_from: torch.Tensor | None,
        gen: torch.Generator | None = None,
    ) -> DraftForward:
        target = self.target
        dtype = self.drafter.fc.weight.dtype
        truth = target_out.hidden_states[target.shape.num_layers]  # [B, T, E]
        inputs = truth[:, :-1].to(dtype)  # input m holds f_m, predicts f_{m+1}
        if gen is not None and self.noise:  # uniform feature noise U(-a/2, a/2), as EAGLE
            noise = (torch.rand(inputs.shape, generator=gen) - 0.5) * self.noise
            inputs = inputs + noise.to(inputs.device, dtype)
        next_embeds = target.embed_tokens(batch.input_ids[:, 1:].to(target.device)).to(dtype)
        seq = batch.input_ids.shape[1]
        positions = torch.arange(seq, device=memory_limit.device)
        # Output position j = m + 1 may use the true f_m only if m < limit[j].
        use_true = (positions[None, :-1] < memory_limit[:, 1:])[..., None]
        stale = int((positions[None] - memory_limit).max())  # device sync, once per batch
        if stale == 0:
            predicted = self.module(next_embeds, inputs)  # [B, T-1, E]: f^_{m+1}
        else:
            predicted = self._unrolled(next_embeds, inputs, memory_limit[:, 1:], use_true, stale)
        final = torch.cat([truth[:, :1].to(dtype), predicted], dim=1)  # position 0: unused
        valid = torch.ones_like(batch.loss_mask)
        valid[:, 0] = False
        return DraftForward(
            target.lm_head(final.to(target.dtype)).float(),
            [(final, truth)],
            valid.to(final.device),
        )

    def _unrolled(
        self,
        next_embeds: torch.Tensor,  # [B, M, E]
        inputs: torch.Tensor,  # [B, M, E] true features
        limit: torch.Tensor,  # [B, M]: the cycle start of each query
        use_true: torch.Tensor,  # [B, M, 1]
        stale: int,
    ) -> torch.Tensor:
        layer, fuse = self.drafter.layer, self.drafter.fuse
        m = torch.arange(inputs.shape[1], device=inputs.device)
        causal = m[None, None, :] <= m[None, :, None]
        earlier = m[None, None, :] < limit[:, :, None]  # keys before the query's cycle
        mask = torch.cat([causal & earlier, causal & ~earlier], dim=-1)[:, None]
        k_true, v_true = layer.kv_from(fuse(next_embeds, inputs), m)
        features = inputs
        for step in range(stale + 1):
            x = fuse(next_embeds, features)
            k, v = layer.kv_from(x, m)
            out = layer(x, m, torch.cat([k_true, k], 2), torch.cat([v_true, v], 2), mask)
            if step < stale:  # feed each prediction f^_m to input m of its own cycle
                features = torch.where(use_true, inputs, torch.cat([inputs[:, :1], out[:, :-1]], 1))
        return out
