"""Prompt-lookup (n-gram) drafting: no model, only the text so far.

The drafts after the last token are what followed the most recent earlier occurrence of the
sequence's last n tokens, for the longest n in [min_n, max_n] that occurs (vLLM's `ngram`
method does the same with its `prompt_lookup_min/max`). Drafts are deterministic, so they go to
verification as point masses (probability 1 on the drafted token): rejection sampling then
accepts x with the target's p(x) and resamples from p with x removed, which is lossless. When
nothing matches, it drafts nothing (the engine's cycle is then a plain step). It costs nearly
nothing, so it is also a natural bottom level of a hierarchy of drafters.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from vllm_moa.decoding.proposer import DraftProposal
from vllm_moa.decoding.sampling import SamplingParams
from vllm_moa.hf_target.adapter import TargetOutput


def lookup(tokens: Sequence[int], k: int, min_n: int = 1, max_n: int = 3) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of tokens' last n tokens,
    trying n = max_n down to min_n; [] if none occurs."""
    end = len(tokens)
    for n in range(min(max_n, end - 1), min_n - 1, -1):
        suffix = list(tokens[end - n :])
        for start in range(end - n - 1, -1, -1):  # latest occurrence first, not the suffix itself
            if list(tokens[start : start + n]) == suffix:
                return list(tokens[start + n : start + n + k])
    return []


class NgramProposer:
    """The Proposer protocol over `lookup`; `vocab_size` sizes the point-mass rows."""

    hidden_layers: tuple[int, ...] = ()

    def __init__(self, vocab_size: int, min_n: int = 1, max_n: int = 3) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.vocab_size, self.min_n, self.max_n = vocab_size, min_n, max_n
        self.tokens: list[int] = []
        self._last_token: int | None = None

    def start(self, prompt_ids: list[int], prefill: TargetOutput) -> None:
        self.tokens = list(prompt_ids)
        self._last_token = None

    def propose(
        self,
        last_token: int,
        num_tokens: int,
        params: SamplingParams,
        generator: torch.Generator | None,
        forced: Sequence[int] = (),
    ) -> DraftProposal:
        given = list(forced[:num_tokens])
        drafts = given + self._continue([*self.tokens, last_token, *given], num_tokens - len(given))
        self._last_token = last_token
        return self._point_masses(drafts, params)

    def draft_after(
        self,
        pending: list[int],
        num_tokens: int,
        params: SamplingParams,
        generator: torch.Generator | None,
    ) -> DraftProposal:
        """Drafts after the tokens and `pending` (a hierarchy's bottom level); no state change."""
        return self._point_masses(self._continue([*self.tokens, *pending], num_tokens), params)

    def _continue(self, seq: list[int], num_tokens: int) -> list[int]:
        """Up to num_tokens drafts after seq, looked up again past each drafted run."""
        drafts: list[int] = []
        seq = list(seq)
        while len(drafts) < num_tokens:
            more = lookup(seq, num_tokens - len(drafts), self.min_n, self.max_n)
            if not more:
                break
            drafts += more
            seq += more
        return drafts

    def _point_masses(self, drafts: list[int], params: SamplingParams) -> DraftProposal:
        points = torch.zeros(len(drafts), self.vocab_size)
        points[torch.arange(len(drafts)), torch.tensor(drafts, dtype=torch.long)] = 1.0
        logits = torch.full_like(points, -1e4).masked_fill_(points.bool(), 0.0)
        return DraftProposal(drafts, logits, None if params.greedy else points)

    def accept(self, accepted: list[int], verified: TargetOutput) -> None:
        if self._last_token is None:
            raise RuntimeError("accept() called without a preceding propose()")
        self.tokens += [self._last_token, *accepted]
        self._last_token = None

    def withdraw(self) -> None:
        self._last_token = None

    def catch_up(self, tokens: list[int], verified: TargetOutput) -> None:
        if self._last_token is not None:
            raise RuntimeError("catch_up() called between propose() and accept()")
        self.tokens += tokens
