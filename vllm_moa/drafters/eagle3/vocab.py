"""EAGLE-3's reduced draft vocabulary: the `n` target tokens the training data trains on most
often, as the authors' `scandata` (SafeAILab/EAGLE eagle/traineagle3/cnets.py) picks them: count
the trained tokens, keep the top n, sort them by id. Draft id i is then the i-th smallest
(`Eagle3Drafter.set_draft_vocab` stores it as the offset d2t[i] = id - i, and t2d).

Differences from theirs, by choice: ties in count go to the smaller token id (theirs: the order
`Counter.most_common` met them, i.e. the data's order), and when the data has fewer than n
distinct trained tokens the rest of the vocabulary is filled with unseen tokens, smallest ids
first (their d2t would then be shorter than their LM head, and their loss would fail on the
shapes)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DraftVocab:
    token_ids: torch.Tensor  # int64 [n]: the draft tokens' target ids, strictly ascending
    coverage: float  # the fraction of the counted (trained) tokens that are draft tokens
    distinct: int  # how many distinct tokens the data trains on


def frequent_tokens(tokens: Iterable[Sequence[int]], vocab_size: int, n: int) -> DraftVocab:
    """The n most frequent of `tokens` (the trained tokens of each example, target ids in
    0..vocab_size-1), ties to the smaller id, filled with unseen ids when fewer are seen."""
    if not 1 <= n <= vocab_size:
        raise ValueError(
            f"--draft-vocab must lie in 1..{vocab_size} (the target's vocabulary), got {n}"
        )
    chunks = [torch.as_tensor(list(t), dtype=torch.long) for t in tokens]
    flat = torch.cat(chunks) if chunks else torch.zeros(0, dtype=torch.long)
    if flat.numel() and not (int(flat.min()) >= 0 and int(flat.max()) < vocab_size):
        raise ValueError(
            f"the training data holds token ids outside 0..{vocab_size - 1} (the target's "
            "vocabulary): tokenised for another model?"
        )
    counts = torch.bincount(flat, minlength=vocab_size)  # [V]
    # A stable descending sort keeps equal counts in ascending id order.
    top = torch.sort(counts, descending=True, stable=True).indices[:n]
    kept = int(counts[top].sum())
    coverage = kept / max(1, flat.numel())
    return DraftVocab(top.sort().values, coverage, int((counts > 0).sum()))
