"""MoA's training forward: SA over the target's embeddings, CA over the K-step bounded memory
of the target's per-layer K|V (or its hidden states), then TLI's target layers and LM head; and
its token-aligned training (the K-step bounded forward holds every pass of a cycle)."""

from __future__ import annotations

import torch

from vllm_moa.drafters.moa.model import MoADrafter
from vllm_moa.hf_target.adapter import HFTarget, TargetOutput
from vllm_moa.training.alignment import AlignedPass, topk_hits, window_mask
from vllm_moa.training.data import Batch
from vllm_moa.training.methods import DraftForward, Method
from vllm_moa.training.tail import run_aligned_tail


class MoAMethod(Method[MoADrafter]):
    k_bounded = True

    def __init__(
        self,
        drafter: MoADrafter,
        target: HFTarget,
        memory_layer: int | None = None,
        feature_noise: float = 0.0,
    ) -> None:
        """`memory_layer`: which hidden state (HF indexing) a memory_source "hidden" drafter reads;
        default the final one (the -LSA ablation; the engine and vLLM serve only that)."""
        super().__init__(drafter, target, feature_noise)
        self.tli = drafter.config.tli
        num_layers = target.shape.num_layers
        self.memory_layer = num_layers if memory_layer is None else memory_layer
        if not 0 <= self.memory_layer <= num_layers:
            raise ValueError(f"memory_layer must be in [0, {num_layers}], got {memory_layer}")
        needed = {num_layers, num_layers - self.tli}
        if not drafter.uses_lsa:
            needed.add(self.memory_layer)
        self.hidden_layers: tuple[int, ...] = tuple(sorted(needed))

    def memory_features(self, target_out: TargetOutput) -> torch.Tensor:
        """What the drafter's memory is computed from: every layer's K|V [B, T, L, 2*E_kv] (LSA)
        or hidden_states[memory_layer] [B, T, E]."""
        if self.drafter.uses_lsa:
            return target_out.layer_kv
        return target_out.hidden_states[self.memory_layer]

    def forward(
        self,
        batch: Batch,
        target_out: TargetOutput,
        memory_limit: torch.Tensor,
        sa_from: torch.Tensor | None,
        gen: torch.Generator | None = None,
    ) -> DraftForward:
        target, num_layers = self.target, self.target.shape.num_layers
        hidden = target_out.hidden_states
        dtype = self.drafter.cross_attention.dtype
        embeds = target.embed_tokens(batch.input_ids.to(target.device)).to(dtype)
        features = self.memory_features(target_out)
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
        """MoA's drafts of a cycle read the memory of the verified prefix and their own drafted
        tokens through SA (and, with TLI, their own predicted states through the tail layers),
        which the K-step bounded forward already gives each position of a cycle: it computes
        every pass at once, position t being pass t - limit[t] + 1 of its cycle. So one
        forward, and GRIFFIN's mask over the cycle's earlier drafts (at most steps-1 of them,
        as m_t's product; none before the cycle's start, which the target verified)."""
        out = self.forward(batch, target_out, memory_limit, sa_from, gen)
        ids = batch.input_ids.to(out.logits.device)
        step = torch.arange(ids.shape[1], device=memory_limit.device) - memory_limit
        hits = topk_hits(out.logits, ids, topk, out.valid)
        return [AlignedPass(out, window_mask(hits, step.to(hits.device), steps))]
