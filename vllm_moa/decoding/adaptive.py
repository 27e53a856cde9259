"""Adaptive speculation length: per step and per request, draft as many tokens (0 included) as
the measured acceptance and costs say pay.

Two online estimates feed one rule.

- `AcceptanceTracker` (one per request): alpha[j], the probability that draft j is accepted
  given drafts 0..j-1 were, as an exponential average over the request's verify steps. The
  expected tokens a step emits with k drafts is E(k) = 1 + sum_{i<k} prod_{j<=i} alpha[j].
  A new request starts from the engine-wide average (`AcceptancePrior`, over all requests),
  and a request's estimates drift back to it while the request does not draft.
- `StepCosts` (one per engine): the verify step's time as a + b * n for n tokens in it (least
  squares over recent steps, exponentially forgotten; b >= 0, and 0 until the steps seen vary
  enough in n to tell), and d, one draft step's time (all requests draft together, so a step
  costs d whether one request drafts or all).

`choose_lengths` then maximises the batch's goodput, expected tokens per second,

    G(k_1..k_B) = sum_r E_r(k_r) / (a + b * sum_r (1 + k_r) + d * max_r k_r),

over k_r <= budget_r: for every candidate number of draft steps m in 0..K, each request takes
the drafts whose expected extra tokens beat their verify cost at the current goodput, up to m;
the best m wins. Plain decoding (m = 0) is one of the candidates, so a drafter that never
matches, or a load where extra verify tokens cost more than they return, ends at K = 0; then
`Probes` has every request draft one token now and then, so that a change is noticed. The
choice only decides how many tokens are drafted; verification is unchanged, so outputs are
exactly those of static speculation (and of plain decoding, greedy).

`VLLM_MOA_ADAPTIVE=0` turns the rule off everywhere (fixed K), e.g. to compare drafting costs at
a fixed K.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

ADAPTIVE_ENV = "VLLM_MOA_ADAPTIVE"


def adaptive_enabled() -> bool:
    return os.environ.get(ADAPTIVE_ENV, "1") != "0"


@dataclass
class AcceptancePrior:
    """The engine-wide acceptance per position, over all requests: where a new request's
    estimates start and where idle estimates drift back to."""

    k_max: int
    # Optimistic: positions never drafted look worth a try (then measured, and corrected).
    start: float = 0.8
    weight: float = 0.05
    alpha: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.alpha = self.alpha or [self.start] * self.k_max


@dataclass
class AcceptanceTracker:
    """Per-position conditional acceptance of one request's drafts (exponential averages)."""

    k_max: int
    prior: AcceptancePrior | None = None  # shared by the engine's requests; own one if None
    weight: float = 0.25  # of each new observation
    relax: float = 0.02  # per step without an observation, pull towards the prior
    alpha: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.prior is None:
            self.prior = AcceptancePrior(self.k_max)
        self.alpha = self.alpha or list(self.prior.alpha[: self.k_max])

    def observe(self, drafted: int, accepted: int) -> None:
        """A verify step of `drafted` drafts that accepted the first `accepted`. Positions past
        the first rejection were not tested and keep their estimate; a step without drafts
        only relaxes the estimates towards the prior."""
        assert self.prior is not None
        for alpha, w in ((self.alpha, self.weight), (self.prior.alpha, self.prior.weight)):
            for j in range(min(drafted, self.k_max)):
                if j < accepted:
                    alpha[j] += w * (1.0 - alpha[j])
                elif j == accepted:
                    alpha[j] -= w * alpha[j]
                else:
                    break
        if drafted == 0:
            for j in range(self.k_max):
                self.alpha[j] += self.relax * (self.prior.alpha[j] - self.alpha[j])

    def gains(self, k: int) -> list[float]:
        """Expected extra tokens from each of the first k drafts: prod_{j<=i} alpha[j]."""
        out, p = [], 1.0
        for j in range(min(k, self.k_max)):
            p *= self.alpha[j]
            out.append(p)
        return out

    def expected_tokens(self, k: int) -> float:
        return 1.0 + sum(self.gains(k))


@dataclass
class StepCosts:
    """Online step-cost model: verify time a + b * tokens, draft step time d (seconds)."""

    forget: float = 0.05  # weight of each new observation in the running moments
    min_spread: float = 1.0  # tokens: below this std of n, b is not identified (taken as 0)
    _w: float = 0.0
    _n: float = 0.0
    _t: float = 0.0
    _nn: float = 0.0
    _nt: float = 0.0
    draft_step: float = 0.0
    _draft_seen: bool = False

    def observe_verify(self, tokens: int, seconds: float) -> None:
        f = self.forget if self._w else 1.0
        self._w += f * (1.0 - self._w)
        self._n += f * (tokens - self._n)
        self._t += f * (seconds - self._t)
        self._nn += f * (tokens * tokens - self._nn)
        self._nt += f * (tokens * seconds - self._nt)

    def observe_draft(self, steps: int, seconds: float) -> None:
        if steps <= 0:
            return
        per_step = seconds / steps
        f = self.forget if self._draft_seen else 1.0
        self.draft_step += f * (per_step - self.draft_step)
        self._draft_seen = True

    @property
    def known(self) -> bool:
        return self._w > 0 and self._draft_seen

    @property
    def per_token(self) -> float:
        var = self._nn - self._n * self._n
        if var < self.min_spread**2:
            return 0.0
        return max(0.0, (self._nt - self._n * self._t) / var)

    @property
    def base(self) -> float:
        return max(self._t - self.per_token * self._n, 0.0)

    def step_time(self, tokens: int, draft_steps: int) -> float:
        return self.base + self.per_token * tokens + self.draft_step * draft_steps


def choose_lengths(
    trackers: list[AcceptanceTracker], budgets: list[int], costs: StepCosts
) -> list[int]:
    """Drafts per request (0..budget) maximising expected tokens per second; see the module
    docstring. Before the costs are known, every request drafts its budget (static K)."""
    if not trackers:
        return []
    if not costs.known:
        return list(budgets)
    return _best_lengths(trackers, budgets, costs)


PROBE_EVERY = 32  # steps between probes, at first


@dataclass
class Probes:
    """While the rule drafts nothing at all, every `every` steps each request drafts one token
    anyway, so that a change (other text, a lighter load) is noticed; the interval doubles (up
    to 16x) while probes change nothing and resets once the rule drafts again."""

    every: int = PROBE_EVERY
    steps: int = 0
    due: int = PROBE_EVERY

    def apply(self, ks: list[int], budgets: list[int]) -> list[int]:
        self.steps += 1
        if any(ks):
            self.every = PROBE_EVERY
            return ks
        if self.steps < self.due:
            return ks
        self.due = self.steps + self.every
        self.every = min(2 * self.every, 16 * PROBE_EVERY)
        return [min(1, b) for b in budgets]


def _best_lengths(
    trackers: list[AcceptanceTracker], budgets: list[int], costs: StepCosts
) -> list[int]:
    """One pass per number of draft steps m = 1, 2, ...: every request takes its leading
    drafts (up to m) whose expected tokens beat their verify cost at the best goodput so far
    (a lower bound of the optimum's, so the rule errs towards drafting); stop at the first m
    that does not improve on m - 1 (acceptance gains only shrink with depth). O(batch * K)."""
    n_req = len(trackers)
    gains = [t.gains(b) for t, b in zip(trackers, budgets, strict=True)]
    best_rate = n_req / max(costs.step_time(n_req, 0), 1e-12)
    best_ks = [0] * n_req
    for m in range(1, max(budgets, default=0) + 1):
        threshold = best_rate * costs.per_token
        ks = [_take_while(g[:m], threshold) for g in gains]
        deepest = max(ks)
        if deepest == 0:
            break
        expected = n_req + sum(sum(g[:k]) for g, k in zip(gains, ks, strict=True))
        rate = expected / max(costs.step_time(n_req + sum(ks), deepest), 1e-12)
        if not rate > best_rate * (1.0 + 1e-9):
            break
        best_rate, best_ks = rate, ks
        if deepest < m:  # nobody takes draft m: deeper steps cannot pay either
            break
    return best_ks


def _take_while(gains: list[float], threshold: float) -> int:
    """How many leading drafts each return more expected tokens than `threshold` costs."""
    k = 0
    for g in gains:
        if g <= threshold:
            break
        k += 1
    return k
