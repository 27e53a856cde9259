"""Hierarchical speculative decoding (HSD): a stack of drafters M0 < M1 < ... below the target.

Only the bottom level drafts autoregressively. Each level above asks the level below for a block,
verifies it in one scoring pass with the lossless rule (verify_greedy / rejection sampling), keeps
the accepted tokens and its own correction or bonus token, and asks again until it holds at least
its buffer size T_i; then it hands the buffer up. The target verifies the top level's buffer last
(Globerson, Kaplan, Mansour, Mohri, Schuster 2025: Algorithm 1, the recursion; Algorithm 2, the
rule). See docs/hsd.md; the latency model and the choice of levels and buffers: plan.py.

Why the output is the target's, whatever the levels: rejection sampling turns proposals into
tokens distributed as the verifier's own samples, provided each proposal comes with the
distribution it was drawn from. A level's buffer holds the lower level's accepted tokens and its
own corrections / bonus tokens, so token t of it, given the tokens before it, is distributed as
this level's distribution at t, which its scoring pass computed: those rows go up with the
tokens (a point mass for the n-gram, whose drafts are deterministic). Whether a buffer reaches
position t depends only on the tokens before t, so the level above may verify the buffer like
any draft chain. By induction the target's verification emits the target's law; greedy, every
level keeps its own argmax and the target's argmax decides, so the text is plain greedy text.
A level's distribution at a position is a function of the tokens before it and of which of them
the target verified (MoA's memory, EAGLE's features), the same one it drafts from.

State: each level keeps the verified prefix (fed by `catch_up` after each target pass, one target
row per verified token); drafting and scoring work on the unverified `pending` tokens and leave
the state as they found it, so a rejection anywhere needs no rollback.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from vllm_moa.decoding.engine import (
    GenerationResult,
    RejectionVerifier,
    check_request,
    emit,
    finish_reason,
    result,
)
from vllm_moa.decoding.ngram_proposer import NgramProposer
from vllm_moa.decoding.proposer import LevelProposer, LevelScorer, choose_token
from vllm_moa.decoding.sampling import (
    SamplingParams,
    Verdict,
    probabilities,
    sample,
    verify_greedy,
    verify_rejection,
)
from vllm_moa.decoding.stats import GenerationStats, LevelStats
from vllm_moa.hf_target.adapter import HFTarget


@dataclass
class Level:
    """One drafter of the stack: its proposer and its buffer size T (the tokens it gathers
    before handing them up; the bottom level drafts T per request)."""

    name: str
    proposer: LevelProposer  # a LevelScorer above the bottom
    buffer: int

    def __post_init__(self) -> None:
        if not isinstance(self.buffer, int) or self.buffer < 1:
            raise ValueError(
                f"level {self.name}: buffer size must be an int >= 1, got {self.buffer}"
            )

    @property
    def has_model(self) -> bool:
        """False for prompt lookup: its drafts cost no forward pass."""
        return not isinstance(self.proposer, NgramProposer)


@dataclass
class Block:
    """What a level hands to the level above."""

    tokens: list[int]  # [n]
    probs: torch.Tensor | None  # [n, V]: the distribution each token was drawn from (None: greedy)


def check_levels(levels: Sequence[Level]) -> None:
    """A stack the engine can run: at least one level, the bottom one drafting, every other one
    able to verify (a scorer)."""
    if not levels:
        raise ValueError("a hierarchy needs at least one drafter level below the target")
    if not isinstance(levels[0].proposer, LevelProposer):
        raise TypeError(
            f"bottom level {levels[0].name}: {type(levels[0].proposer).__name__} cannot draft "
            "after unverified tokens (it has no draft_after())"
        )
    for i, level in enumerate(levels[1:], start=1):
        if not isinstance(level.proposer, LevelScorer):
            raise ValueError(
                f"level {i} ({level.name}) cannot verify the level below it: "
                f"{type(level.proposer).__name__} has no distribution to score drafts with; "
                "it can only be the bottom level (first in the list)"
            )


class HierarchicalEngine:
    """The standalone engine's loop with a stack of drafters instead of one (see the module
    docstring). `rejection_verifier` is used at every level (injectable, so that tests can show
    the distribution test catches a broken one)."""

    def __init__(
        self,
        target: HFTarget,
        levels: Sequence[Level],
        rejection_verifier: RejectionVerifier = verify_rejection,
    ) -> None:
        check_levels(levels)
        self.target = target
        self.levels = list(levels)
        self.rejection_verifier = rejection_verifier
        layers = {i for level in self.levels for i in level.proposer.hidden_layers}
        self.hidden_layers = tuple(sorted(layers))

    @torch.no_grad()
    def generate(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        params: SamplingParams | None = None,
        eos_token_ids: Sequence[int] = (),
        seed: int | None = None,
    ) -> GenerationResult:
        params = params or SamplingParams()
        check_request(self.target, prompt_ids, max_new_tokens)
        target = self.target
        gen = torch.Generator(device=target.device)
        gen.manual_seed(seed) if seed is not None else gen.seed()
        # A level's buffer is at most its T plus the largest block of the level below.
        stats = GenerationStats(sum(level.buffer for level in self.levels))
        stats.levels = [LevelStats(level.name, level.buffer) for level in self.levels]
        eos = set(eos_token_ids)
        t0 = time.perf_counter()

        target.reset()
        prompt = list(prompt_ids)
        out = target.forward(torch.tensor(prompt), self.hidden_layers)
        stats.num_target_calls += 1
        for level in self.levels:
            level.proposer.start(prompt, out)
        generated = [choose_token(out.logits[-1], params, gen)[0]]
        finish = finish_reason(target, generated, len(prompt), max_new_tokens, eos)
        while finish is None:
            position = len(prompt) + len(generated) - 1  # of the last token, not yet run
            room = min(target.max_length - position - 2, max_new_tokens - len(generated) - 1)
            new = self._cycle(generated[-1], position, room, params, gen, stats)
            finish = emit(target, generated, new, len(prompt), max_new_tokens, eos)
        return result(target, generated, finish, stats, t0)

    def _cycle(
        self,
        last: int,
        position: int,
        room: int,
        params: SamplingParams,
        gen: torch.Generator,
        stats: GenerationStats,
    ) -> list[int]:
        """One target pass over the top level's buffer (at most `room` tokens; none near the
        end); every level then takes the verified tokens. Returns the emitted tokens."""
        top = len(self.levels) - 1
        block = (
            self._gather(top, [last], room, params, gen, stats) if room >= 1 else Block([], None)
        )
        out = self.target.forward(torch.tensor([last, *block.tokens]), self.hidden_layers)
        probs = None if params.greedy else probabilities(out.logits, params)
        verdict = self._verify(block, out.logits, probs, gen)
        a = verdict.num_accepted
        self.target.crop(position + a + 1)
        kept = out.select(list(range(a + 1)))
        for level in self.levels:
            level.proposer.catch_up([last, *block.tokens[:a]], kept)
        _count(stats.levels[top], block, a)
        stats.record_cycle(len(block.tokens), a)
        return [*block.tokens[:a], verdict.next_token]

    def _gather(
        self,
        i: int,
        pending: list[int],
        limit: int,
        params: SamplingParams,
        gen: torch.Generator,
        stats: GenerationStats,
    ) -> Block:
        """Level i's block after the verified prefix and `pending` (this cycle's unverified
        tokens, the last sampled one first): the bottom drafts min(T_0, limit); a level above
        gathers rounds (a block from below, scored and verified) until it holds min(T_i, limit)
        or more, never more than `limit`."""
        level, record = self.levels[i], stats.levels[i]
        record.requests += 1
        if i == 0:
            k = min(level.buffer, limit)
            if k < 1:
                return Block([], None)
            record.requested += k
            began = time.perf_counter()
            proposal = level.proposer.draft_after(pending, k, params, gen)
            record.time_s += time.perf_counter() - began
            record.forward_passes += len(proposal.tokens) if level.has_model else 0
            return Block(proposal.tokens, proposal.probs)
        scorer = level.proposer
        assert isinstance(scorer, LevelScorer)  # check_levels
        tokens: list[int] = []
        rows: list[torch.Tensor] = []
        while len(tokens) < min(level.buffer, limit):
            context = [*pending, *tokens]
            lower = self._gather(i - 1, context, limit - len(tokens) - 1, params, gen, stats)
            began = time.perf_counter()
            logits = scorer.score(context, lower.tokens)  # [n+1, V]
            probs = None if params.greedy else probabilities(logits, params)
            verdict = self._verify(lower, logits, probs, gen)
            a = verdict.num_accepted
            record.time_s += time.perf_counter() - began
            record.forward_passes += 1
            _count(stats.levels[i - 1], lower, a)
            tokens += [*lower.tokens[:a], verdict.next_token]
            if probs is not None:  # this level's law of each token it keeps (Algorithm 2)
                rows.append(probs[: a + 1])
        return Block(tokens, torch.cat(rows) if rows else None)

    def _verify(
        self,
        block: Block,
        logits: torch.Tensor,  # [n+1, V]: the verifying level's, after block.tokens[:j]
        probs: torch.Tensor | None,  # [n+1, V]: processed (None when greedy)
        gen: torch.Generator,
    ) -> Verdict:
        if probs is None:
            return verify_greedy(block.tokens, logits)
        if not block.tokens:  # nothing drafted (the n-gram found no match): one sample
            return Verdict(0, sample(probs[0], gen))
        assert block.probs is not None
        return self.rejection_verifier(block.tokens, block.probs, probs, gen)


def _count(record: LevelStats, block: Block, accepted: int) -> None:
    """A level's block verified by the level above, which accepted `accepted` of it."""
    record.proposed += len(block.tokens)
    record.accepted += accepted
    record.rejections += int(accepted < len(block.tokens))
