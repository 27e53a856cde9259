"""Which hierarchy to run: the expected latency per token of a stack of drafters, and an exact
search over the stacks and buffer sizes a set of measured candidates allows.

The model (IID acceptance, as in Globerson et al. 2025; docs/hsd.md derives it). Level i verifies
a token of level i-1 with probability alpha_i, independently; a pass over n tokens costs
base + per_token * n seconds. For the stack M_0 .. M_{K-1} below the target M_K:

- the bottom drafts T_0 tokens per request (prompt lookup: with probability `draft_rate`, else
  none), at `draft_step_s` per drafted token;
- level i (0 < i < K) repeats rounds until it holds >= T_i tokens: a request to level i-1
  (a block of n ~ S_{i-1} tokens), one scoring pass over n+1 positions, and a = min(G, n)
  accepted drafts plus its own token, G geometric (P(G >= j) = alpha_i^j). gamma_i, the expected
  rounds per request, and S_i, the law of the size it hands up, follow from a dynamic programme
  over the tokens held so far (0..T_i-1), exact; the expected cost of a request follows by Wald's
  identity: C_i = gamma_i * (C_{i-1} + E[score_i(n+1)]);
- the target verifies n ~ S_{K-1} tokens per pass and emits E = E[(1 - alpha_K^(n+1)) /
  (1 - alpha_K)] tokens, which every level then takes in (`commit`: MoA's memory rows, say);
  latency per token L = (C_{K-1} + E[target(n+1)] + sum_i commit_i(E)) / E (renewal-reward).

With constant costs this is the paper's L = sum_i c_i prod_{j>=i} R_j; with one drafter, the
standard (T c_draft + c_target) (1 - alpha) / (1 - alpha^(T+1)).

The search is exhaustive (every order-preserving subset of the candidates, every buffer size
up to `max_buffer`), sharing the state of common prefixes: with a handful of candidates that is
a few thousand evaluations, exact under the model, where the paper's reduction to a generalised
shortest path is needed for dozens of candidate early exits.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TARGET = "target"  # the acceptance table's name for the target


@dataclass(frozen=True)
class PassCost:
    """Seconds of one forward pass over n tokens: base_s + per_token_s * n."""

    base_s: float
    per_token_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("base_s", "per_token_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0 seconds, got {value}")

    def seconds(self, tokens: float) -> float:
        return self.base_s + self.per_token_s * tokens

    def plus(self, other: PassCost) -> PassCost:
        return PassCost(self.base_s + other.base_s, self.per_token_s + other.per_token_s)


@dataclass(frozen=True)
class Candidate:
    """A level that may go into a stack, with its measured costs."""

    name: str  # `ngram` or a drafter directory, as `generate --hierarchy` takes it
    draft_step_s: float  # one autoregressive draft step (as the bottom level), per drafted token
    score: PassCost | None  # one scoring pass (as a level above the bottom); None: cannot verify
    draft_rate: float = 1.0  # drafted / requested tokens as the bottom (prompt lookup: < 1)
    # taking the target-verified tokens after each target pass, per token (MoA: their memory)
    commit: PassCost = PassCost(0.0)

    def __post_init__(self) -> None:
        if not (math.isfinite(self.draft_step_s) and self.draft_step_s >= 0):
            raise ValueError(f"{self.name}: draft_step_s must be >= 0, got {self.draft_step_s}")
        if not 0 <= self.draft_rate <= 1:
            raise ValueError(f"{self.name}: draft_rate must be in [0, 1], got {self.draft_rate}")


@dataclass(frozen=True)
class PlanInputs:
    """What the planner needs, measured (`vllm-moa hsd-plan --measure`) or given (`--from`)."""

    candidates: tuple[Candidate, ...]  # bottom-up: a stack keeps this order
    target: PassCost  # the target's verification pass over n tokens
    # acceptance[lower][upper]: alpha, the per-token acceptance of lower's tokens by upper (a
    # later candidate or TARGET); a missing pair is never stacked.
    acceptance: dict[str, dict[str, float]]
    notes: dict[str, Any] = field(default_factory=dict)  # how it was measured (free form)

    def __post_init__(self) -> None:
        names = [c.name for c in self.candidates]
        if len(set(names)) != len(names) or TARGET in names:
            raise ValueError(f"candidate names must be distinct and not {TARGET!r}: {names}")
        for lower, row in self.acceptance.items():
            for upper, alpha in row.items():
                if not 0 <= alpha <= 1:
                    raise ValueError(f"acceptance[{lower}][{upper}] must be in [0, 1], got {alpha}")

    def alpha(self, lower: str, upper: str) -> float | None:
        return self.acceptance.get(lower, {}).get(upper)

    def to_dict(self) -> dict[str, Any]:
        return {
            "candidates": [
                {
                    "name": c.name,
                    "draft_step_s": c.draft_step_s,
                    "score": None if c.score is None else vars(c.score),
                    "draft_rate": c.draft_rate,
                    "commit": vars(c.commit),
                }
                for c in self.candidates
            ],
            "target": vars(self.target),
            "acceptance": self.acceptance,
            "notes": self.notes,
        }

    @staticmethod
    def from_dict(data: dict[str, Any]) -> PlanInputs:
        try:
            candidates = tuple(
                Candidate(
                    name=str(c["name"]),
                    draft_step_s=float(c["draft_step_s"]),
                    score=None if c.get("score") is None else PassCost(**c["score"]),
                    draft_rate=float(c.get("draft_rate", 1.0)),
                    commit=PassCost(**c.get("commit", {"base_s": 0.0})),
                )
                for c in data["candidates"]
            )
            return PlanInputs(
                candidates, PassCost(**data["target"]), data["acceptance"], data.get("notes", {})
            )
        except (KeyError, TypeError) as e:
            raise ValueError(
                f"not a planner input (candidates, target, acceptance; see docs/hsd.md): {e!r}"
            ) from None

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @staticmethod
    def load(path: str | Path) -> PlanInputs:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"planner input {path} does not exist")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not JSON: {e}") from None
        return PlanInputs.from_dict(data)


@dataclass(frozen=True)
class Plan:
    """A stack (bottom first, the target above it) and what the model expects of it."""

    levels: tuple[str, ...]  # () = plain decoding
    buffers: tuple[int, ...]  # T per level
    latency_s: float  # expected seconds per output token
    tokens_per_target_call: float
    passes_per_token: tuple[float, ...]  # forward passes per output token: each level, target

    def to_dict(self) -> dict[str, Any]:
        return {
            "levels": list(self.levels),
            "buffers": list(self.buffers),
            "latency_s": self.latency_s,
            "tokens_per_second": 1 / self.latency_s if self.latency_s > 0 else math.inf,
            "tokens_per_target_call": self.tokens_per_target_call,
            "passes_per_token": list(self.passes_per_token),
        }


@dataclass(frozen=True)
class _Stage:
    """The model's state after a level: what one request to it yields and costs."""

    sizes: tuple[float, ...]  # sizes[n] = P(the level hands up n tokens)
    cost_s: float  # expected seconds of one request, the levels below included
    passes: tuple[float, ...]  # expected forward passes per request, each level so far
    commit: PassCost  # all levels so far: taking the verified tokens after a target pass


def bottom_stage(candidate: Candidate, buffer: int) -> _Stage:
    sizes = [0.0] * (buffer + 1)
    sizes[buffer] += candidate.draft_rate
    sizes[0] += 1 - candidate.draft_rate
    drafted = candidate.draft_rate * buffer
    cost = drafted * candidate.draft_step_s
    return _Stage(tuple(sizes), cost, (drafted,), candidate.commit)


def round_increments(sizes: Sequence[float], alpha: float) -> list[float]:
    """P(a round adds d tokens), d = a + 1: a = min(G, n) accepted of n ~ sizes drafts."""
    out = [0.0] * (len(sizes) + 1)
    for n, weight in enumerate(sizes):
        if weight == 0:
            continue
        for a in range(n):
            out[a + 1] += weight * alpha**a * (1 - alpha)
        out[n + 1] += weight * alpha**n
    return out


def upper_stage(
    below: _Stage, score: PassCost, alpha: float, buffer: int, commit: PassCost = PassCost(0.0)
) -> _Stage:
    """A scoring level above `below` with buffer T (the DP of the module docstring)."""
    steps = round_increments(below.sizes, alpha)
    visits = [0.0] * buffer  # visits[s] = P(some round starts holding s tokens)
    visits[0] = 1.0
    sizes = [0.0] * (buffer + len(steps))
    for s in range(buffer):
        if visits[s] == 0:
            continue
        for d, p in enumerate(steps):
            if p == 0:
                continue
            if s + d < buffer:
                visits[s + d] += visits[s] * p
            else:
                sizes[s + d] += visits[s] * p
    rounds = sum(visits)  # gamma: expected rounds per request
    mean_below = sum(n * w for n, w in enumerate(below.sizes))
    cost = rounds * (below.cost_s + score.seconds(mean_below + 1))
    passes = (*(rounds * x for x in below.passes), rounds)
    return _Stage(tuple(sizes), cost, passes, below.commit.plus(commit))


def top_plan(
    stage: _Stage, target: PassCost, alpha: float, levels: tuple[str, ...], buffers: tuple[int, ...]
) -> Plan:
    """The target over the top level's blocks: the plan's latency per token."""
    tokens = sum(w * _emitted(alpha, n) for n, w in enumerate(stage.sizes))
    mean = sum(n * w for n, w in enumerate(stage.sizes))
    # A target pass, the stack's requests before it, and every level taking the verified tokens
    cost = stage.cost_s + target.seconds(mean + 1) + stage.commit.seconds(tokens)
    passes = tuple(x / tokens for x in (*stage.passes, 1.0))
    return Plan(levels, buffers, cost / tokens, tokens, passes)


def _emitted(alpha: float, n: int) -> float:
    """Expected tokens of a verification of n drafts: accepted + the target's own."""
    return float(n + 1) if alpha >= 1 else (1 - alpha ** (n + 1)) / (1 - alpha)


def plain_plan(inputs: PlanInputs) -> Plan:
    return Plan((), (), inputs.target.seconds(1), 1.0, (1.0,))


def evaluate(inputs: PlanInputs, levels: Sequence[str], buffers: Sequence[int]) -> Plan:
    """The model's expectations for one stack (ValueError naming a pair it lacks)."""
    by_name = {c.name: c for c in inputs.candidates}
    if len(levels) != len(buffers) or not levels:
        raise ValueError(f"one buffer size per level: {len(levels)} levels, {len(buffers)} buffers")
    for name in levels:
        if name not in by_name:
            raise ValueError(f"{name!r} is not a measured candidate: {sorted(by_name)}")
    if any(t < 1 for t in buffers):
        raise ValueError(f"buffer sizes must be >= 1, got {list(buffers)}")
    stage = bottom_stage(by_name[levels[0]], buffers[0])
    for lower, upper, t in zip(levels, levels[1:], buffers[1:], strict=False):
        score, alpha = by_name[upper].score, inputs.alpha(lower, upper)
        if score is None:
            raise ValueError(
                f"{upper} cannot verify (it has no scoring cost): put it at the bottom"
            )
        if alpha is None:
            raise ValueError(f"no acceptance measured for {lower} -> {upper}")
        stage = upper_stage(stage, score, alpha, t, by_name[upper].commit)
    alpha = inputs.alpha(levels[-1], TARGET)
    if alpha is None:
        raise ValueError(f"no acceptance measured for {levels[-1]} -> {TARGET}")
    return top_plan(stage, inputs.target, alpha, tuple(levels), tuple(buffers))


def search(inputs: PlanInputs, max_buffer: int = 8) -> Iterator[Plan]:
    """Every stack the inputs allow (order kept, a non-scorer only at the bottom, measured pairs
    only) with every buffer size in 1..max_buffer: one Plan each, plain decoding first."""
    if max_buffer < 1:
        raise ValueError(f"max_buffer must be >= 1, got {max_buffer}")
    yield plain_plan(inputs)
    cands = inputs.candidates

    def grow(
        stage: _Stage, top: int, levels: tuple[str, ...], buffers: tuple[int, ...]
    ) -> Iterator[Plan]:
        alpha = inputs.alpha(cands[top].name, TARGET)
        if alpha is not None:
            yield top_plan(stage, inputs.target, alpha, levels, buffers)
        for j in range(top + 1, len(cands)):
            score, pair = cands[j].score, inputs.alpha(cands[top].name, cands[j].name)
            if score is None or pair is None:
                continue
            for t in range(1, max_buffer + 1):
                up = upper_stage(stage, score, pair, t, cands[j].commit)
                yield from grow(up, j, (*levels, cands[j].name), (*buffers, t))

    for i, cand in enumerate(cands):
        for t in range(1, max_buffer + 1):
            yield from grow(bottom_stage(cand, t), i, (cand.name,), (t,))


def best_plans(inputs: PlanInputs, max_buffer: int = 8) -> list[Plan]:
    """The best buffer sizes for each stack, fastest first (plain decoding among them)."""
    best: dict[tuple[str, ...], Plan] = {}
    for plan in search(inputs, max_buffer):
        if plan.levels not in best or plan.latency_s < best[plan.levels].latency_s:
            best[plan.levels] = plan
    return sorted(best.values(), key=lambda p: p.latency_s)
