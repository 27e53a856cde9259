"""What the engine asks of a drafter, whatever its architecture."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from vllm_moa.decoding.sampling import SamplingParams, probabilities, sample
from vllm_moa.decoding.tree import DraftTree
from vllm_moa.hf_target.adapter import TargetOutput


@dataclass
class DraftProposal:
    tokens: list[int]  # [K] drafted token ids
    logits: torch.Tensor  # [K, V] float32 raw drafter logits
    probs: torch.Tensor | None  # [K, V] distributions the drafts were sampled from; None if greedy


class Proposer(Protocol):
    """A drafter with incremental state, driven by the engine once per verification cycle.

    Protocol: `start` after the prefill; then per cycle `propose` K drafts after the last token,
    the target verifies them, and `accept` reports the accepted drafts with the target's output
    rows for the kept positions (the proposer's last token plus the accepted drafts). Cycles
    the engine decodes plainly are handed over later, together, by `catch_up`.
    """

    hidden_layers: tuple[int, ...]  # target hidden states the proposer needs in TargetOutput

    def start(self, prompt_ids: list[int], prefill: TargetOutput) -> None: ...

    def propose(
        self,
        last_token: int,
        num_tokens: int,
        params: SamplingParams,
        generator: torch.Generator | None,
        forced: Sequence[int] = (),
    ) -> DraftProposal:
        """`forced`: the first drafts are these tokens (teacher forcing), so a drafter can
        write on after text it did not choose (a client finishing a response alone)."""
        ...

    def accept(self, accepted: list[int], verified: TargetOutput) -> None: ...

    def withdraw(self) -> None:
        """Forget the last proposal, which will never be verified (a client whose server went
        away): the state becomes what it was before `propose`."""
        ...

    def catch_up(self, tokens: list[int], verified: TargetOutput) -> None:
        """Tokens the engine decoded without drafting (each the last token of a plain target
        step, in order), with the target's rows for them: the state becomes what
        `propose(t, 0)` + `accept([], row)` for each would have made it, in one go (adaptive
        speculation skips the proposer while it drafts nothing)."""
        ...


@runtime_checkable
class TreeProposer(Proposer, Protocol):
    """A proposer that also drafts EAGLE-2 trees: `propose_tree` instead of `propose` in a
    cycle, then `accept` with the accepted path (MoA, EAGLE and independent drafters)."""

    def propose_tree(self, last_token: int, depth: int, breadth: int, budget: int) -> DraftTree: ...


@runtime_checkable
class LevelProposer(Proposer, Protocol):
    """A proposer that can be the bottom level of a hierarchy (hsd/hierarchy.py): it drafts
    after tokens the target has not verified yet. `pending`: the tokens after the verified
    prefix, the sampled-but-unverified last token first, then what the levels above accepted
    this cycle. The call leaves the proposer's state as it found it (the verified prefix only);
    what the target keeps reaches it through `catch_up`."""

    def draft_after(
        self,
        pending: list[int],
        num_tokens: int,
        params: SamplingParams,
        generator: torch.Generator | None,
    ) -> DraftProposal: ...


@runtime_checkable
class LevelScorer(LevelProposer, Protocol):
    """A proposer that can also verify the level below it (an intermediate level): `score`
    returns its next-token logits [n+1, V] after `pending` + tokens[:j] for j = 0..n, the same
    distributions it drafts from, computed together (one pass over the new positions where its
    architecture allows). Like `draft_after`, it leaves the state as it found it."""

    def score(self, pending: list[int], tokens: list[int]) -> torch.Tensor: ...


def draft_token(
    logits: torch.Tensor,
    i: int,
    forced: Sequence[int],
    params: SamplingParams,
    generator: torch.Generator | None,
) -> tuple[int, torch.Tensor | None]:
    """Draft i: `forced[i]` if given (with the distribution it would have been sampled from,
    so a proposal's probs stay one row per draft), else `choose_token`."""
    if i < len(forced):
        return forced[i], None if params.greedy else probabilities(logits, params)
    return choose_token(logits, params, generator)


def choose_token(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> tuple[int, torch.Tensor | None]:
    """Pick a draft token from drafter logits [V]: argmax when greedy, else sample from the
    processed distribution (returned, since verification needs it)."""
    if params.greedy:
        return int(logits.argmax().item()), None  # device sync
    probs = probabilities(logits, params)
    return sample(probs, generator), probs


def stack_proposal(
    drafts: list[int], logits: list[torch.Tensor], probs: list[torch.Tensor]
) -> DraftProposal:
    """A proposal from its drafts, their logits rows [V] and sampling distributions [V]."""
    return DraftProposal(
        tokens=drafts,
        logits=torch.stack(logits) if logits else torch.empty(0),
        probs=torch.stack(probs) if probs else None,
    )


def check_catch_up(last_token: int | None, tokens: list[int], verified: TargetOutput) -> None:
    """What catch_up() checks of a proposer keeping no per-token target rows: its last proposal
    was accepted or withdrawn, and `verified` holds one row per token."""
    if last_token is not None:
        raise RuntimeError("catch_up() called between propose() and accept()")
    if verified.logits.shape[0] != len(tokens):
        raise ValueError(
            f"catch_up() needs one verified row per token: {len(tokens)} tokens, "
            f"{verified.logits.shape[0]} rows"
        )
