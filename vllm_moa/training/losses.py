"""Distillation losses over masked positions."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def masked_kl(
    target_logits: torch.Tensor,
    draft_logits: torch.Tensor,
    mask: torch.Tensor,
    vocab: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mean over masked positions of KL(target || drafter); logits [B, T, V], mask [B, T].
    `vocab` (bool [V], a reduced draft vocabulary, the drafter's logits -inf outside it): both
    distributions are the softmax over its columns only (the EAGLE-3 authors' target
    `softmax(logits[..., t2d])`)."""
    t = target_logits[mask].float()
    d = draft_logits[mask].float()
    if vocab is not None:
        t, d = t[:, vocab], d[:, vocab]
    t, d = t.log_softmax(-1), d.log_softmax(-1)
    return (t.exp() * (t - d)).sum(-1).mean()


def vocab_positions(target_logits: torch.Tensor, vocab: torch.Tensor | None) -> torch.Tensor | None:
    """[B, T] bool, the positions a drafter with a reduced draft vocabulary trains: those whose
    target argmax (over the whole vocabulary) lies in `vocab` (bool [V]), the EAGLE-3 authors'
    `t2d[target.argmax(-1)]`; None without one. target_logits [B, T, V]."""
    return None if vocab is None else vocab[target_logits.argmax(-1)]


def masked_smooth_l1(pred: torch.Tensor, target: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Smooth L1 between hidden states [B, T, E] over masked positions (mean over elements)."""
    return F.smooth_l1_loss(pred[mask].float(), target[mask].float())
