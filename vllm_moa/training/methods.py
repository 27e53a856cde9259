"""What each drafter method computes on a training batch: draft logits and predicted features.

A method turns (batch, the frozen target's outputs on it, per-query memory limits) into a
`DraftForward`; the trainer turns that into the loss. Memory limits express staleness: a query at
position i may use target information only from positions < limit[i] (MOA_SPEC's K-step bounded
Cross-Attention; EAGLE is 1-step bounded, so its limit is always i).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from vllm_moa.model.moa import MoADrafter
from vllm_moa.target.adapter import HFTarget, TargetOutput
from vllm_moa.training.data import Batch
from vllm_moa.training.tail import run_aligned_tail


@dataclass
class DraftForward:
    logits: torch.Tensor  # [B, T, V]: drafter's next-token logits at each position
    # (predicted, true) hidden-state pairs [B, T, E] for the feature loss (averaged)
    features: list[tuple[torch.Tensor, torch.Tensor]]


class DraftMethod(Protocol):
    model: nn.Module  # the trainable drafter
    module: nn.Module  # what forward() calls: the drafter, or its DDP wrapper
    hidden_layers: tuple[int, ...]  # target hidden states the method needs

    def forward(
        self,
        batch: Batch,
        target_out: TargetOutput,
        memory_limit: torch.Tensor,
        sa_from: torch.Tensor | None,
    ) -> DraftForward: ...


class MoAMethod:
    def __init__(self, drafter: MoADrafter, target: HFTarget) -> None:
        drafter.config.check_target(target.shape)
        self.drafter = drafter
        self.model: nn.Module = drafter
        self.module: nn.Module = drafter
        self.target = target
        self.tli = drafter.config.tli
        num_layers = target.shape.num_layers
        self.hidden_layers = tuple(sorted({num_layers, num_layers - self.tli}))

    def forward(
        self,
        batch: Batch,
        target_out: TargetOutput,
        memory_limit: torch.Tensor,
        sa_from: torch.Tensor | None,
    ) -> DraftForward:
        target, num_layers = self.target, self.target.shape.num_layers
        hidden = target_out.hidden_states
        dtype = self.drafter.cross_attention.input_layernorm.weight.dtype
        embeds = target.embed_tokens(batch.input_ids).to(dtype)
        features = target_out.layer_kv if self.drafter.uses_lsa else hidden[num_layers]
        predicted = self.module(embeds, features.to(dtype), memory_limit, sa_from)
        if self.tli == 0:
            # The release trains the CA output against the final, normalised state.
            return DraftForward(
                target.lm_head(predicted.to(target.dtype)).float(),
                [(predicted, hidden[num_layers])],
            )
        final = run_aligned_tail(target, predicted, target_out.layer_kv, memory_limit, self.tli)
        return DraftForward(
            target.lm_head(final).float(),
            [(predicted, hidden[num_layers - self.tli]), (final, hidden[num_layers])],
        )
