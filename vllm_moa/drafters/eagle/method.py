"""EAGLE's training forward, 1-step bounded (unrolled when evaluation asks for stale steps), and
its token-aligned multi-pass training (HASS, GRIFFIN)."""

from __future__ import annotations

import torch

from vllm_moa.drafters.eagle.model import EagleDrafter
from vllm_moa.hf_target.adapter import HFTarget, TargetOutput
from vllm_moa.training.alignment import AlignedPass, chained_masks, topk_hits
from vllm_moa.training.data import Batch
from vllm_moa.training.methods import DraftForward, Method


class EagleMethod(Method[EagleDrafter]):
    """EAGLE: input m = (x_{m+1}, f_m + noise) predicts f_{m+1}. Trained 1-step bounded (true
    features everywhere). When memory limits ask for stale steps (evaluation), the forward is
    unrolled so every query sees what it sees at inference: keys of earlier cycles computed from
    true features, keys of its own cycle from the features it predicted. GRIFFIN's drafter is
    trained by this method too (its fusion and its two heads are the drafter's)."""

    k_bounded = False

    def __init__(self, drafter: EagleDrafter, target: HFTarget, feature_noise: float = 0.0) -> None:
        super().__init__(drafter, target, feature_noise)
        self.hidden_layers: tuple[int, ...] = drafter.feature_layers()

    def _inputs(
        self, batch: Batch, target_out: TargetOutput, gen: torch.Generator | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(embeddings of x_{m+1} [B, T-1, E], input features f_m (+ noise) [B, T-1, E], the
        features f of every position [B, T, E], the feature loss's truth)."""
        target = self.target
        dtype = self.drafter.fc.weight.dtype
        truth = self.drafter.target_features(target_out.hidden_states)  # [B, T, E]
        inputs = truth[:, :-1].to(dtype)  # input m holds f_m, predicts f_{m+1}
        if gen is not None and self.noise:  # uniform feature noise U(-a/2, a/2), as EAGLE
            noise = (torch.rand(inputs.shape, generator=gen) - 0.5) * self.noise
            inputs = inputs + noise.to(inputs.device, dtype)
        next_embeds = target.embed_tokens(batch.input_ids[:, 1:].to(target.device)).to(dtype)
        return next_embeds, inputs, truth

    def _output(self, out: torch.Tensor, truth: torch.Tensor) -> DraftForward:
        """The layer's outputs at inputs 0..T-2 [B, T-1, W] -> logits and feature pairs at
        positions 1..T-1 (position 0 predicts nothing)."""
        state, feature = self.drafter.heads(out)
        head = truth[:, :1].to(self.drafter.fc.weight.dtype)
        final = torch.cat([head, state], dim=1)
        predicted = final if feature is state else torch.cat([head, feature], dim=1)
        valid = torch.ones(truth.shape[:2], dtype=torch.bool, device=final.device)
        valid[:, 0] = False
        logits = self.drafter.logits(final, self._target_head).float()
        return DraftForward(logits, self._feature_pairs(predicted, truth), valid)

    def _target_head(self, states: torch.Tensor) -> torch.Tensor:
        return self.target.lm_head(states.to(self.target.dtype))

    def _feature_pairs(
        self, predicted: torch.Tensor, truth: torch.Tensor
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The feature loss's (predicted, true) pairs [B, T, E]: EAGLE regresses f_{i+1}."""
        return [(predicted, truth)]

    def forward(
        self,
        batch: Batch,
        target_out: TargetOutput,
        memory_limit: torch.Tensor,
        sa_from: torch.Tensor | None,
        gen: torch.Generator | None = None,
    ) -> DraftForward:
        next_embeds, inputs, truth = self._inputs(batch, target_out, gen)
        seq = batch.input_ids.shape[1]
        positions = torch.arange(seq, device=memory_limit.device)
        stale = int((positions[None] - memory_limit).max())  # device sync, once per batch
        if stale == 0:
            out = self.module(next_embeds, inputs)  # [B, T-1, W]
        else:
            # Output position j = m + 1 may use the true f_m only if m < limit[j].
            use_true = (positions[None, :-1] < memory_limit[:, 1:])[..., None]
            out = self._unrolled(next_embeds, inputs, memory_limit[:, 1:], use_true, stale)
        return self._output(out, truth)

    def aligned(
        self,
        batch: Batch,
        target_out: TargetOutput,
        memory_limit: torch.Tensor,
        sa_from: torch.Tensor | None,
        gen: torch.Generator | None,
        steps: int,
        topk: int,
    ) -> list[AlignedPass]:
        """`steps` passes (EagleDrafter.forward); pass j (1-based) at position o is the j-th
        draft of the cycle whose first draft is o - j + 1, fed the features the earlier passes
        predicted and the data's tokens. Its mask keeps o while the data's tokens at the
        cycle's earlier drafts were in those drafts' top-k (`chained_masks`). The memory limits
        are ignored: every pass is trained fresh from the verified prefix."""
        next_embeds, inputs, truth = self._inputs(batch, target_out, gen)
        raw = self.module(next_embeds, inputs, steps).unflatten(0, (steps, -1))
        outs = [self._output(r, truth) for r in raw]
        ids = batch.input_ids.to(truth.device)
        hits = [topk_hits(o.logits, ids, topk, o.valid) for o in outs[:-1]]
        masks = chained_masks(hits, ids.shape, ids.device)
        return [AlignedPass(o, m) for o, m in zip(outs, masks, strict=True)]

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
            if step < stale:  # feed each predicted f^_m to input m of its own cycle
                fed = self.drafter.heads(out)[1]
                features = torch.where(use_true, inputs, torch.cat([inputs[:, :1], fed[:, :-1]], 1))
        return out
