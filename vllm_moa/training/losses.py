"""Distillation losses over masked positions."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def masked_kl(
    target_logits: torch.Tensor, draft_logits: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Mean over masked positions of KL(target || drafter); logits [B, T, V], mask [B, T]."""
    t = target_logits[mask].float().log_softmax(-1)
    d = draft_logits[mask].float().log_softmax(-1)
    return (t.exp() * (t - d)).sum(-1).mean()


def masked_smooth_l1(pred: torch.Tensor, target: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Smooth L1 between hidden states [B, T, E] over masked positions (mean over elements)."""
    return F.smooth_l1_loss(pred[mask].float(), target[mask].float())
