"""What each drafter method computes on a training batch: draft logits and predicted features.

A method turns (batch, the frozen target's outputs on it, per-query memory limits) into a
`DraftForward`; the trainer turns that into the loss. Memory limits express staleness: a query at
position i may use target information only from positions < limit[i] (MOA_SPEC's K-step bounded
Cross-Attention; EAGLE is 1-step bounded, so its limit is always i).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

import torch
from torch import nn

from vllm_moa.hf_target.adapter import HFTarget, TargetOutput
from vllm_moa.model.baselines import EagleDrafter, IndependentDrafter
from vllm_moa.model.config import DrafterConfig
from vllm_moa.training.data import Batch


@dataclass
class DraftForward:
    logits: torch.Tensor  # [B, T, V]: drafter's next-token logits at each position
    # (predicted, true) hidden-state pairs [B, T, E] for the feature loss (averaged)
    features: list[tuple[torch.Tensor, torch.Tensor]]
    valid: torch.Tensor | None = None  # [B, T] bool: positions the method predicts at all


class DraftMethod(Protocol):
    model: nn.Module  # the trainable drafter
    module: nn.Module  # what forward() calls: the drafter, or its DDP wrapper
    hidden_layers: tuple[int, ...]  # target hidden states the method needs
    k_bounded: bool  # trained with K-step bounded memory (MoA); False: always fresh (EAGLE)

    def forward(
        self,
        batch: Batch,
        target_out: TargetOutput,
        memory_limit: torch.Tensor,
        sa_from: torch.Tensor | None,
        gen: torch.Generator | None = None,
    ) -> DraftForward: ...


D = TypeVar("D", bound=nn.Module)


class Method(Generic[D]):
    """What every method holds: the trainable drafter (checked against the target), what
    forward() calls (the drafter until DDP wraps it), the frozen target, and the noise added to
    the target features the drafter reads in training steps (EAGLE's recipe; only EAGLE uses it)."""

    def __init__(self, drafter: D, target: HFTarget, feature_noise: float = 0.0) -> None:
        config: DrafterConfig = getattr(drafter, "config")  # noqa: B009 (typed access)
        config.check_target(target.shape)
        self.drafter: D = drafter
        self.model: nn.Module = drafter
        self.module: nn.Module = drafter
        self.target = target
        self.noise = feature_noise


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


class IndependentMethod(Method[IndependentDrafter]):
    """A small LM over the target's embeddings and LM head, distilled with the KL term only."""

    hidden_layers: tuple[int, ...] = ()
    k_bounded = False

    def forward(
        self,
        batch: Batch,
        target_out: TargetOutput,
        memory_limit: torch.Tensor,
        sa_from: torch.Tensor | None,
        gen: torch.Generator | None = None,
    ) -> DraftForward:
        dtype = self.drafter.norm.weight.dtype
        embeds = self.target.embed_tokens(batch.input_ids.to(self.target.device)).to(dtype)
        hidden = self.module(embeds)
        return DraftForward(self.target.lm_head(hidden.to(self.target.dtype)).float(), [])
