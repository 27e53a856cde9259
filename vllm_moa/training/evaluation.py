"""Held-out acceptance proxy: top-1 agreement with the target per draft step.

With refresh interval K, the query at stale step s (0..K-1 positions after the last target
verification) is scored on whether its argmax equals the target's. For a chain of K drafts with
per-step agreement a_s, the proxy mean acceptance length is 1 + sum_k prod_{s<k} a_s.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from vllm_moa.hf_target.adapter import HFTarget
from vllm_moa.model.masks import bounded_memory_limits
from vllm_moa.training.config import TrainConfig
from vllm_moa.training.data import Example, collate
from vllm_moa.training.losses import masked_kl, vocab_positions
from vllm_moa.training.methods import DraftMethod
from vllm_moa.training.schedule import response_tokens


def proxy_tau(agreement: Sequence[float]) -> float:
    tau, run = 1.0, 1.0
    for a in agreement:
        run *= a
        tau += run
    return tau


@torch.no_grad()
def evaluate(
    method: DraftMethod,
    target: HFTarget,
    examples: Sequence[Example],
    cfg: TrainConfig,
    pad_id: int,
) -> dict[str, Any]:
    k = cfg.eval_refresh
    hits, counts = torch.zeros(k), torch.zeros(k)
    kl_total, batches = 0.0, 0
    for start in range(0, len(examples), cfg.batch_size):
        batch = collate(examples[start : start + cfg.batch_size], pad_id)
        seq = batch.input_ids.shape[1]
        target_out = target.forward_batch(batch.input_ids, method.hidden_layers)
        turns = response_tokens(batch.loss_mask)
        limits = torch.stack(
            [
                bounded_memory_limits(seq, int(p), k, r)
                for p, r in zip(batch.prompt_len.tolist(), turns, strict=True)
            ]
        )
        out = method.forward(batch, target_out, limits.to(target.device), None)
        positions = torch.arange(seq)
        response = batch.loss_mask & (positions[None] >= batch.prompt_len[:, None])
        if out.valid is not None:
            response &= out.valid.cpu()
        stale = positions[None] - limits
        hit = (out.logits.argmax(-1) == target_out.logits.argmax(-1)).cpu()
        for s in range(k):
            sel = response & (stale == s)
            hits[s] += hit[sel].sum()
            counts[s] += sel.sum()
        # A reduced draft vocabulary (EAGLE-3): the KL the loss trains (restricted to it, at the
        # positions whose target argmax lies in it); the agreement above counts the others as
        # misses, as drafting would.
        kl_mask = batch.loss_mask.to(target.device)
        in_vocab = vocab_positions(target_out.logits, out.vocab)
        kl_mask = kl_mask if in_vocab is None else kl_mask & in_vocab
        kl_total += masked_kl(target_out.logits, out.logits, kl_mask, out.vocab).item()
        batches += 1
    agreement = (hits / counts.clamp_min(1)).tolist()
    return {
        "agreement_per_step": agreement,
        "proxy_tau": proxy_tau(agreement),
        "kl": kl_total / max(1, batches),
    }
