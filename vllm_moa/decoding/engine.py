"""The standalone speculative engine: chain drafting, lossless verification, one sequence.

Without a proposer the same loop is plain autoregressive decoding, the baseline. With one and
`adaptive=True`, the chain length of each cycle adapts to the measured acceptance and costs
(decoding/adaptive.py); a cycle of 0 drafts is a plain target step that keeps the proposer's
state in step. Off by default here (measured on the CPU testbed pair: 0.80x plain adaptive
against 1.01x at the fixed K, while vLLM's adaptive path is on by default; see issue 25).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from vllm_moa.decoding.adaptive import (
    AcceptancePrior,
    AcceptanceTracker,
    Probes,
    StepCosts,
    adaptive_enabled,
    choose_lengths,
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
from vllm_moa.target.adapter import HFTarget, TargetOutput

RejectionVerifier = Callable[
    [list[int], torch.Tensor, torch.Tensor, "torch.Generator | None"], Verdict
]


@dataclass
class GenerationResult:
    token_ids: list[int]  # generated ids only (an EOS that ended generation included)
    finish_reason: str  # "eos" | "length" (max_new_tokens) | "context" (model's max length)
    stats: GenerationStats


def _rows(out: TargetOutput, rows: list[int]) -> TargetOutput:
    """The given rows of a target pass (the kept positions)."""
    index = torch.tensor(rows, device=out.logits.device)
    return TargetOutput(
        logits=out.logits[index],
        layer_kv=out.layer_kv[index],
        hidden_states={k: v[index] for k, v in out.hidden_states.items()},
    )


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
        # Adaptive speculation's measurements, kept across requests (injectable for tests).
        self.step_costs = step_costs or StepCosts()
        self._priors: dict[int, AcceptancePrior] = {}

    def _check_request(
        self, prompt_ids: Sequence[int], max_new_tokens: int, num_speculative_tokens: int
    ) -> None:
        vocab = self.target.shape.vocab_size
        if not prompt_ids:
            raise ValueError("prompt is empty: give at least one token")
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if self.proposer is not None and num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        limit = self.target.max_length
        if len(prompt_ids) >= limit:
            raise ValueError(
                f"prompt has {len(prompt_ids)} tokens but the model's context is {limit}: "
                f"shorten it to at most {limit - 1} tokens"
            )

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
        adaptive: bool | None = None,
    ) -> GenerationResult:
        """Chain drafting of num_speculative_tokens (up to it, chosen per cycle, when `adaptive`;
        None: off, see the module docstring), or EAGLE-2 trees when `tree` is given (its depth
        then plays the part of K; trees are not adapted)."""
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
        adaptive = bool(adaptive) and adaptive_enabled() and proposer is not None and tree is None
        costs, probes = self.step_costs, Probes()
        tracker = AcceptanceTracker(k_max, self._priors.setdefault(k_max, AcceptancePrior(k_max)))
        t0 = time.perf_counter()

        target.reset()
        prompt = list(prompt_ids)
        out = target.forward(torch.tensor(prompt), hidden_layers)
        stats.num_target_calls += 1
        generated = [choose_token(out.logits[-1], params, gen)[0]]
        if proposer is not None:
            proposer.start(prompt, out)
        finish = self._finish_reason(generated, len(prompt), max_new_tokens, eos)
        plain_step = False
        while finish is None:
            last = generated[-1]
            position = len(prompt) + len(generated) - 1  # of `last`, not yet run by the target
            k = min(k_max, target.max_length - position - 2, max_new_tokens - len(generated) - 1)
            if k >= 1 and tree is not None:
                new = self._speculate_tree(last, position, k, tree, params, gen, stats)
            elif k >= 1 and adaptive:
                k = probes.apply(choose_lengths([tracker], [k], costs), [k])[0]
                new = self._speculate(last, position, k, params, gen, stats, costs)
                tracker.observe(k, len(new) - 1)
            elif k >= 1 and proposer is not None:
                new = self._speculate(last, position, k, params, gen, stats)
            else:  # plain decoding, or the final token where no draft can fit
                out = target.forward(torch.tensor([last]), hidden_layers)
                stats.record_cycle(0, 0)
                new = [choose_token(out.logits[-1], params, gen)[0]]
                plain_step = proposer is not None  # leaves the proposer behind: must be last
            for token in new:
                generated.append(token)
                finish = self._finish_reason(generated, len(prompt), max_new_tokens, eos)
                if finish is not None:
                    break
            if finish is None and plain_step:
                raise RuntimeError("internal: a plain step with a proposer must be the last one")

        if target.device.type == "cuda":
            torch.cuda.synchronize()
        stats.wall_time_s = time.perf_counter() - t0
        stats.num_generated_tokens = len(generated)
        return GenerationResult(token_ids=generated, finish_reason=finish, stats=stats)

    def _speculate(
        self,
        last: int,
        position: int,
        k: int,
        params: SamplingParams,
        gen: torch.Generator,
        stats: GenerationStats,
        costs: StepCosts | None = None,
    ) -> list[int]:
        """One draft + verify cycle from `last` at `position` (k = 0: a plain step through the
        proposer); returns the emitted tokens. `costs`: record the draft and verify times."""
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
        a = verdict.num_accepted
        if costs is not None:  # verdict read the target's output: the times are complete
            costs.observe_draft(k, drafted - started)
            costs.observe_verify(k + 1, time.perf_counter() - drafted)
        self.target.crop(position + a + 1)
        self.proposer.accept(proposal.tokens[:a], _rows(out, list(range(a + 1))))
        stats.record_cycle(k, a)
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
        self.proposer.accept(accepted, _rows(out, rows))
        stats.record_cycle(depth, len(accepted))
        return [*accepted, verdict.next_token]

    def _finish_reason(
        self, generated: list[int], prompt_len: int, max_new_tokens: int, eos: set[int]
    ) -> str | None:
        if generated[-1] in eos:
            return "eos"
        if len(generated) >= max_new_tokens:
            return "length"
        if prompt_len + len(generated) >= self.target.max_length:
            return "context"
        return None
