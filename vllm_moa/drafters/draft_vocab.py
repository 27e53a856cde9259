"""A reduced draft vocabulary, shared by the kinds that have one (EAGLE-3: its own LM head's rows;
MoA: the rows of the target's LM head its drafts read): the `n` target tokens the training data
trains on most often, as the EAGLE-3 authors' `scandata` (SafeAILab/EAGLE
eagle/traineagle3/cnets.py) picks them: count the trained tokens, keep the top n, sort them by
id. Draft id i is then the i-th smallest (EAGLE-3 stores it as the offset d2t[i] = id - i, and
t2d; MoA stores the ids).

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


def check_draft_vocab(ids: torch.Tensor, draft_vocab_size: int, vocab_size: int) -> None:
    """Raise unless `ids` (int64) are draft_vocab_size strictly ascending ids in 0..V-1."""
    if tuple(ids.shape) != (draft_vocab_size,):
        raise ValueError(
            f"the draft vocabulary must hold draft_vocab_size = {draft_vocab_size} token ids, got "
            f"shape {tuple(ids.shape)}"
        )
    ascending = bool((ids[1:] > ids[:-1]).all())  # device sync
    in_range = bool(((ids >= 0) & (ids < vocab_size)).all())  # device sync
    if not (ascending and in_range):
        raise ValueError(
            f"the draft vocabulary's target ids must be strictly ascending in 0..{vocab_size - 1} "
            "(draft id i = the i-th smallest, as the authors' d2t and vLLM's scatter need); "
            "rebuild it (`vllm-moa train --draft-vocab`)"
        )


def check_loaded_draft_vocab(
    buffer: str, ids: torch.Tensor, draft_vocab_size: int, vocab_size: int
) -> None:
    """`check_draft_vocab` on a drafter's draft vocabulary as loaded (a load_state_dict hook's
    check), its error naming the buffer it was read from (`buffer`: "d2t", "draft_ids")."""
    try:
        check_draft_vocab(ids, draft_vocab_size, vocab_size)
    except ValueError as e:
        raise ValueError(f"{buffer}: {e}") from None
