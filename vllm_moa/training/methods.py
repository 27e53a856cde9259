"""What every drafter kind's training method shares (each kind's own method:
vllm_moa/drafters/KIND/method.py): it computes draft logits and predicted features on a batch.

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
from vllm_moa.model.config import DrafterConfig
from vllm_moa.training.data import Batch


@dataclass
class DraftForward:
    logits: torch.Tensor  # [B, T, V]: drafter's next-token logits at each position
    # (predicted, true) hidden-state pairs [B, T, E] for the feature loss (averaged)
    features: list[tuple[torch.Tensor, torch.Tensor]]
    valid: torch.Tensor | None = None  # [B, T] bool: positions the method predicts at all
    # [V] bool: a reduced draft vocabulary (EAGLE-3's t2d; `logits` are -inf outside it). The
    # loss then trains the target's distribution restricted to it, at the positions whose
    # target argmax lies in it (losses.py `vocab_positions`, as the EAGLE-3 authors).
    vocab: torch.Tensor | None = None


@dataclass
class AlignedPass:
    """One pass of token-aligned training (training/alignment.py)."""

    forward: DraftForward  # the pass's logits and feature pairs
    mask: torch.Tensor  # [B, T] bool: m_t, the positions this pass trains (before the loss mask)


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
        """Token-aligned training (vllm_moa/training/alignment.py): the kind's `steps` passes,
        each with its mask m_t (a pass at position t drafts the token after t, fed the data's
        tokens and the kind's own earlier predictions as at inference)."""
        ...


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
