"""The standalone speculative engine: chain drafting, lossless verification, one sequence.

Without a proposer the same loop is plain autoregressive decoding, the baseline. With one, the
chain length of each cycle adapts to the measured acceptance and costs (vllm_moa/adaptive.py;
on by default, `adaptive=False` or VLLM_MOA_ADAPTIVE=0 for the fixed K). A cycle of 0 drafts is
a plain target step that leaves the proposer alone: its rows are handed over (`catch_up`) when
the engine next drafts, so a drafter that does not pay costs next to nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from vllm_moa.adaptive import (
    AdaptiveLengths,
    DraftGuard,
    OneRequest,
    StepCosts,
    adaptive_enabled,
)
from vllm_moa.decoding.proposer import Proposer, TreeProposer, choose_token
from vllm_moa.decoding.sampling import (
    SamplingParams,
    Verdict,
    probabilities,
    verify_greedy,
    verify_rejection,
)
from vllm_moa.decoding.stats import GenerationStats
from vllm_moa.decoding.tree import TreeParams, verify_tree_greedy, verify_tree_sampling
from vllm_moa.hf_target.adapter import HFTarget, TargetOutput

RejectionVerifier = Callable[
    [list[int], torch.Tensor, torch.Tensor, "torch.Generator | None"], Verdict
]


@dataclass
class GenerationResult:
    token_ids: list[int]  # generated ids only (an EOS that ended generation included)
    finish_reason: str  # "eos" | "length" (max_new_tokens) | "context" (model's max length)
    stats: GenerationStats


@dataclass
class Backlog:
    """Target rows the proposer has not seen yet: the prompt's, until the first drafting cycle
    (`start`), then those of the cycles decoded without drafts (`catch_up`). A drafter that
    never drafts never pays for them."""

    proposer: Proposer
    tokens: list[int]
    rows: list[TargetOutput]
    started: bool = False

    def add(self, token: int, row: TargetOutput) -> None:
        self.tokens.append(token)
        self.rows.append(row)

    def flush(self) -> None:
        if self.started and not self.tokens:
            return
        rows = self.rows[0] if len(self.rows) == 1 else TargetOutput.concat(self.rows)
        if self.started:
            self.proposer.catch_up(self.tokens, rows)
        else:
            self.proposer.start(self.tokens, rows)
            self.started = True
        self.tokens, self.rows = [], []


class SpeculativeEngine:
    def __init__(
        self,
        target: HFTarget,
        proposer: Proposer | None = None,
        rejection_verifier: RejectionVerifier = verify_rejection,
        step_costs: StepCosts | None = None,
    ) -> None:
        self.target = target
        self.proposer = proposer
        # Injectable so tests can prove the distribution test catches a broken verifier.
        self.rejection_verifier = rejection_verifier
        # Adaptive speculation's measurements, kept across requests (injectable for tests: an
        # injected cost model decides alone, without the guard's measured check of it).
        self.step_costs = step_costs or StepCosts(cold_phases=1)
        self._guard_enabled = step_costs is None
        self.adaptive_lengths: dict[int, AdaptiveLengths] = {}  # by K: prior, probes, choices
        # Adaptive speculation leaves seeded sampled requests undrafted (see generate()).
        self.repeatable_seeds = True

    def _check_request(
        self, prompt_ids: Sequence[int], max_new_tokens: int, num_speculative_tokens: int
    ) -> None:
        check_request(self.target, prompt_ids, max_new_tokens)
        if self.proposer is not None and num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")

    @torch.no_grad()
    def generate(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        params: SamplingParams | None = None,
        num_speculative_tokens: int = 4,
        eos_token_ids: Sequence[int] = (),
        seed: int | None = None,
        tree: TreeParams | None = None,
        adaptive: bool = True,
    ) -> GenerationResult:
        """Chain drafting of up to num_speculative_tokens, the length chosen per cycle
        (`adaptive`, unless VLLM_MOA_ADAPTIVE=0; else always K), or EAGLE-2 trees when `tree` is
        given (its depth then plays the part of K; trees are not adapted). With `adaptive` and
        `repeatable_seeds`, a seeded request at temperature > 0 decodes without drafts: the
        lengths follow measured times, and the random draws the lengths, so its text would not
        repeat (it is then plain decoding's text for that seed)."""
        params = params or SamplingParams()
        if tree is not None:
            if not isinstance(self.proposer, TreeProposer):
                raise ValueError(
                    "tree decoding needs a drafter that drafts trees (MoA, EAGLE or "
                    f"independent); the proposer is {type(self.proposer).__name__}"
                )
            num_speculative_tokens = tree.depth
        self._check_request(prompt_ids, max_new_tokens, num_speculative_tokens)
        target, proposer = self.target, self.proposer
        gen = torch.Generator(device=target.device)
        gen.manual_seed(seed) if seed is not None else gen.seed()
        k_max = num_speculative_tokens if proposer is not None else 0
        stats = GenerationStats(k_max)
        hidden_layers = proposer.hidden_layers if proposer is not None else ()
        eos = set(eos_token_ids)
        adaptive = adaptive and adaptive_enabled() and proposer is not None and tree is None
        seeded_sampling = seed is not None and not params.greedy
        no_drafts = adaptive and seeded_sampling and self.repeatable_seeds
        costs = self.step_costs
        lengths = self.adaptive_lengths.get(k_max)
        if lengths is None:
            guard = DraftGuard(enabled=self._guard_enabled)
            lengths = self.adaptive_lengths[k_max] = AdaptiveLengths(k_max, costs, guard=guard)
        policy = OneRequest.of(lengths)
        t0 = time.perf_counter()

        target.reset()
        prompt = list(prompt_ids)
        out = target.forward(torch.tensor(prompt), hidden_layers)
        stats.num_target_calls += 1
        generated = [choose_token(out.logits[-1], params, gen)[0]]
        # The proposer sees the prompt (start) and plain cycles (catch_up) when it next drafts.
        behind = Backlog(proposer, list(prompt), [out]) if proposer is not None else None
        finish = finish_reason(target, generated, len(prompt), max_new_tokens, eos)
        while finish is None:
            last = generated[-1]
            position = len(prompt) + len(generated) - 1  # of `last`, not yet run by the target
            k = min(k_max, target.max_length - position - 2, max_new_tokens - len(generated) - 1)
            if no_drafts:
                k = 0
            if adaptive and k >= 1:
                catch_up = len(behind.tokens) if behind is not None else 0
                k = policy.choose(k, catch_up, max_new_tokens - len(generated))
            drafted_before = stats.num_draft_tokens
            probe_cost = None
            cycle_began = time.perf_counter()
            if k >= 1 and behind is not None:
                began = cycle_began
                backlog = len(behind.tokens)
                behind.flush()
                caught_up = time.perf_counter() - began
                if tree is not None:
                    new = self._speculate_tree(last, position, k, tree, params, gen, stats)
                else:
                    timed = costs if adaptive else None
                    new = self._speculate(
                        last, position, k, params, gen, stats, timed, (backlog, caught_up)
                    )
                probe_cost = caught_up + costs.step_time(0, k) - costs.base
            else:  # plain decoding, a cycle of 0 drafts, or the last token (no room to draft)
                new = [self._plain_step(last, params, gen, stats, costs, behind)]
            if adaptive:
                drafted = stats.num_draft_tokens - drafted_before
                seconds = time.perf_counter() - cycle_began
                policy.observe(drafted, len(new) - 1, seconds, probe_cost)
            finish = emit(target, generated, new, len(prompt), max_new_tokens, eos)
        return result(target, generated, finish, stats, t0)

    def _plain_step(
        self,
        last: int,
        params: SamplingParams,
        gen: torch.Generator,
        stats: GenerationStats,
        costs: StepCosts,
        behind: Backlog | None,
    ) -> int:
        """One target step without drafts; its row waits in `behind` for the proposer."""
        started = time.perf_counter()
        hidden_layers = self.proposer.hidden_layers if self.proposer is not None else ()
        out = self.target.forward(torch.tensor([last]), hidden_layers)
        token = choose_token(out.logits[-1], params, gen)[0]
        stats.record_cycle(0, 0)
        if behind is not None:
            costs.observe_verify(1, time.perf_counter() - started)
            behind.add(last, out)
        return token

    def _speculate(
        self,
        last: int,
        position: int,
        k: int,
        params: SamplingParams,
        gen: torch.Generator,
        stats: GenerationStats,
        costs: StepCosts | None = None,
        backlog: tuple[int, float] = (0, 0.0),
    ) -> list[int]:
        """One draft + verify cycle from `last` at `position` (k = 0: a plain step through the
        proposer); returns the emitted tokens. `costs`: record the verify time and the draft
        phase's (drafting, the proposer's bookkeeping of the verified tokens, and `backlog`:
        the rows of plain cycles it caught up on just before, and the seconds that took)."""
        assert self.proposer is not None
        started = time.perf_counter()
        proposal = self.proposer.propose(last, k, params, gen)
        drafted = time.perf_counter()
        out = self.target.forward(
            torch.tensor([last, *proposal.tokens]), self.proposer.hidden_layers
        )
        if not proposal.tokens:
            verdict = Verdict(0, choose_token(out.logits[-1], params, gen)[0])
        elif params.greedy:
            verdict = verify_greedy(proposal.tokens, out.logits)
        else:
            assert proposal.probs is not None
            target_probs = probabilities(out.logits, params)
            verdict = self.rejection_verifier(proposal.tokens, proposal.probs, target_probs, gen)
        a, n = verdict.num_accepted, len(proposal.tokens)  # n <= k: some proposers draft fewer
        verified = time.perf_counter()  # the verdict read the target's output: it is complete
        self.target.crop(position + a + 1)
        self.proposer.accept(proposal.tokens[:a], out.select(list(range(a + 1))))
        if costs is not None:
            costs.observe_verify(n + 1, verified - drafted)
            phase = drafted - started + time.perf_counter() - verified + backlog[1]
            costs.observe_draft(n, phase, rows=backlog[0] + a + 1)
        stats.record_cycle(n, a)
        return [*proposal.tokens[:a], verdict.next_token]

    def _speculate_tree(
        self,
        last: int,
        position: int,
        depth: int,
        tree: TreeParams,
        params: SamplingParams,
        gen: torch.Generator,
        stats: GenerationStats,
    ) -> list[int]:
        """One tree draft + verify cycle from `last` at `position`; returns the emitted tokens."""
        assert isinstance(self.proposer, TreeProposer)  # checked in generate()
        draft = self.proposer.propose_tree(last, depth, tree.breadth, tree.budget)
        ids, positions, allowed = draft.verification_inputs(last, position)
        out = self.target.forward_tree(ids, positions, allowed, self.proposer.hidden_layers)
        if params.greedy:
            verdict = verify_tree_greedy(draft, out.logits)
        else:
            verdict = verify_tree_sampling(draft, probabilities(out.logits, params), gen)
        rows = [0] + [i + 1 for i in verdict.path]
        self.target.cache.keep(position, [position + r for r in rows])
        accepted = [draft.tokens[i] for i in verdict.path]
        self.proposer.accept(accepted, out.select(rows))
        stats.record_cycle(depth, len(accepted))
        return [*accepted, verdict.next_token]


def check_request(target: HFTarget, prompt_ids: Sequence[int], max_new_tokens: int) -> None:
    """A prompt and length the target can take (ValueError naming the fix otherwise)."""
    vocab = target.shape.vocab_size
    if not prompt_ids:
        raise ValueError("prompt is empty: give at least one token")
    bad = [t for t in prompt_ids if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    limit = target.max_length
    if len(prompt_ids) >= limit:
        raise ValueError(
            f"prompt has {len(prompt_ids)} tokens but the model's context is {limit}: "
            f"shorten it to at most {limit - 1} tokens"
        )


def emit(
    target: HFTarget,
    generated: list[int],
    new: Sequence[int],
    prompt_len: int,
    max_new_tokens: int,
    eos: set[int],
) -> str | None:
    """Append a cycle's `new` tokens to `generated` up to the first that ends generation; why it
    ends (None: it goes on)."""
    finish = None
    for token in new:
        generated.append(token)
        finish = finish_reason(target, generated, prompt_len, max_new_tokens, eos)
        if finish is not None:
            break
    return finish


def result(
    target: HFTarget, generated: list[int], finish: str, stats: GenerationStats, began: float
) -> GenerationResult:
    """The finished generation, its wall time counted from `began` (GPU work included)."""
    if target.device.type == "cuda":
        torch.cuda.synchronize()
    stats.wall_time_s = time.perf_counter() - began
    stats.num_generated_tokens = len(generated)
    return GenerationResult(token_ids=generated, finish_reason=finish, stats=stats)


def finish_reason(
    target: HFTarget, generated: list[int], prompt_len: int, max_new_tokens: int, eos: set[int]
) -> str | None:
    """Why generation stops after `generated` (None: it goes on)."""
    if generated[-1] in eos:
        return "eos"
    if len(generated) >= max_new_tokens:
        return "length"
    if prompt_len + len(generated) >= target.max_length:
        return "context"
    return None
