"""Token-aligned training (GRIFFIN, arXiv 2502.11018, Section 4.1), shared by every kind.

A drafter drafts a cycle's tokens from its own previous drafts; training feeds it the data's
tokens. The two agree on the branch of the draft tree that follows the data, and that branch
exists only while every earlier draft of the cycle had the data's token among its top-k
candidates (a tree expands the top-k children of a node). GRIFFIN trains a draft only then:

    m̄_t = [x_{t+1} in top-k(drafter's logits at t)]        (the "predictability" of draft t)
    m_t  = prod_{i = t-n+1}^{t-1} m̄_i                       (pass n, the paper's Eq. for m_t)
    L^(n) = sum_t m_t l_t / sum_t m_t,   loss = sum_{n=1}^{N} L^(n)

Positions: the drafter's logits at t predict token t+1 (as the target's logits at t), so the
draft at t is right when the data's next token x_{t+1} is among its top-k. Pass n at position t
is the n-th draft of a cycle whose first draft is at t-n+1; its earlier drafts are pass n-1 at
t-1, pass n-2 at t-2, ... The released code (main_griffin_2.py) shifts this product by one
position (pass n at t uses pass n-1's hit at t itself); this module follows the paper, whose
product is what makes the masked training forward the inference forward on the data's branch.

Each kind says what its passes are (its method's `aligned`): EAGLE/GRIFFIN run them
(`EagleDrafter.forward(passes=N)`); the independent drafter's passes all coincide (tokens only,
no features: `coinciding_passes`); MoA's one K-step bounded forward holds every pass of a cycle
at once (`window_mask`). docs/training.md, "Token-aligned training", has the whole story.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from vllm_moa.training.losses import masked_kl, masked_smooth_l1, vocab_positions
from vllm_moa.training.methods import AlignedPass, DraftForward


def topk_hits(
    logits: torch.Tensor,  # [B, T, V]: the drafter's logits at t predict token t+1
    input_ids: torch.Tensor,  # [B, T]
    k: int,
    valid: torch.Tensor | None = None,  # [B, T] bool: positions that draft at all
) -> torch.Tensor:
    """[B, T] bool, the paper's m̄: the data's token at t+1 is among the top-k of the logits at
    t. False at the last position (nothing follows) and where not `valid`. k = 0: every draft
    counts as right (no mask: EAGLE-3's training-time test trains every position of every pass)."""
    if k < 0:
        raise ValueError(f"align_topk must be >= 0, got {k}")
    if k == 0:
        hits = torch.ones(input_ids.shape, dtype=torch.bool, device=logits.device)
        hits[:, -1] = False
    else:
        top = logits[:, :-1].topk(min(k, logits.shape[-1]), dim=-1).indices  # [B, T-1, k]
        hits = F.pad((top == input_ids[:, 1:, None]).any(-1), (0, 1), value=False)
    return hits & valid if valid is not None else hits


def _shifted(x: torch.Tensor, d: int) -> torch.Tensor:
    """[B, T] -> y[:, t] = x[:, t - d], False for t < d."""
    return F.pad(x[:, : x.shape[1] - d], (d, 0), value=False)


def chained_masks(
    hits: Sequence[torch.Tensor], shape: torch.Size, device: torch.device
) -> list[torch.Tensor]:
    """The masks m of passes 1..len(hits)+1, each [B, T] (`shape`), from the hits of passes
    1..len(hits): m_1 = all; m_{n+1}[t] = m_n[t-1] & hits_n[t-1], so
    m_n[t] = prod_{d=1}^{n-1} hits_{n-d}[t-d]. A cycle cannot start before position 0."""
    masks = [torch.ones(shape, dtype=torch.bool, device=device)]
    for hit in hits:
        masks.append(_shifted(masks[-1] & hit, 1))
    return masks


def window_mask(hits: torch.Tensor, step: torch.Tensor, steps: int) -> torch.Tensor:
    """[B, T] bool for one forward whose position t is the (step[t]+1)-th draft of its cycle
    (MoA, step = t - memory limit): m_t = prod hits[t-d], d = 1..min(step[t], steps-1), i.e.
    the paper's m_t over the last steps-1 drafts, none before the cycle's start."""
    mask = torch.ones_like(hits)
    for d in range(1, steps):
        mask &= _shifted(hits, d) | (step < d)
    return mask


def coinciding_passes(
    out: DraftForward, input_ids: torch.Tensor, steps: int, topk: int
) -> list[AlignedPass]:
    """A drafter whose passes all compute `out` (the independent drafter: its n-th draft from
    the data's tokens is its forward at that position): the same logits under the masks of
    passes 1..steps."""
    hits = topk_hits(out.logits, input_ids, topk, out.valid)
    masks = chained_masks([hits] * (steps - 1), hits.shape, hits.device)
    return [AlignedPass(out, m) for m in masks]


@dataclass
class AlignedLoss:
    loss: torch.Tensor  # scalar, differentiable: sum over passes
    kl: float  # sum over passes of each pass's KL (as `loss`)
    feature: float  # sum over passes of each pass's feature loss
    tokens: int  # positions of pass 1 (what a step trains on, as without alignment)
    kept: float  # of the positions every pass could train, the fraction its mask kept


def aligned_loss(
    passes: Sequence[AlignedPass],
    target_logits: torch.Tensor,  # [B, T, V]
    loss_mask: torch.Tensor,  # [B, T] bool
    kl_weight: float,
    feature_weight: float,
    decay: float = 1.0,
) -> AlignedLoss:
    """sum_n decay^(n-1) L^(n), each pass's loss the mean over its masked positions (the
    GRIFFIN paper's L^(n); decay 1 is its sum, EAGLE-3 weights pass n by 0.8^(n-1)). A later
    pass whose mask is empty adds nothing (pass 1 always counts, as without alignment)."""
    bases = [loss_mask if p.forward.valid is None else loss_mask & p.forward.valid for p in passes]
    # A reduced draft vocabulary (EAGLE-3): every pass leaves out the positions whose target
    # argmax is outside it (the authors' per-step target mask; it does not chain across passes).
    bases = [
        _in_vocab(b, target_logits, p.forward.vocab) for b, p in zip(bases, passes, strict=True)
    ]
    masks = [b & p.mask for b, p in zip(bases, passes, strict=True)]
    counts = torch.stack([m.sum() for m in [*masks, *bases]]).tolist()  # device sync, once
    kept_counts, base_counts = counts[: len(passes)], counts[len(passes) :]
    terms = []
    kl_total = feature_total = 0.0
    for n, (p, mask) in enumerate(zip(passes, masks, strict=True)):
        if n and not kept_counts[n]:
            continue
        kl = masked_kl(target_logits, p.forward.logits, mask, p.forward.vocab)
        pairs = p.forward.features
        feature = sum(masked_smooth_l1(a, b, mask) for a, b in pairs) / max(1, len(pairs))
        terms.append(decay**n * (kl_weight * kl + feature_weight * feature))
        kl_total += float(kl.detach())  # device sync
        feature_total += float(feature.detach()) if isinstance(feature, torch.Tensor) else 0.0
    loss = terms[0]
    for term in terms[1:]:
        loss = loss + term
    kept = sum(kept_counts) / max(1, sum(base_counts))
    return AlignedLoss(loss, kl_total, feature_total, int(base_counts[0]), kept)


def _in_vocab(
    mask: torch.Tensor, target_logits: torch.Tensor, vocab: torch.Tensor | None
) -> torch.Tensor:
    """`mask` [B, T] less the positions whose target argmax is outside a reduced `vocab`."""
    positions = vocab_positions(target_logits, vocab)
    return mask if positions is None else mask & positions
