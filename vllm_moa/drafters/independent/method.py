"""The independent drafter's training forward: the target's LM head on its output, no features;
token-aligned training with passes that coincide."""

from __future__ import annotations

import torch

from vllm_moa.drafters.independent.model import IndependentDrafter
from vllm_moa.hf_target.adapter import TargetOutput
from vllm_moa.training.alignment import AlignedPass, coinciding_passes
from vllm_moa.training.data import Batch
from vllm_moa.training.methods import DraftForward, Method


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
        """Its own previous predictions are drafted tokens only (no features, no memory), and
        along the data's branch those are the data's tokens: pass n's logits at t are the
        forward's, so one forward serves every pass, each under its own mask. Feeding it its
        argmax tokens instead would leave the target's distributions (computed on the data)
        without a context they belong to (the paper's Section 3: the naive swap fails)."""
        out = self.forward(batch, target_out, memory_limit, sa_from, gen)
        return coinciding_passes(out, batch.input_ids.to(out.logits.device), steps, topk)
