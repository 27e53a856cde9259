"""Adaptive speculation length: per step and per request, draft as many tokens (0 included) as
the measured acceptance and costs say pay.

Two online estimates feed one rule.

- `AcceptanceTracker` (one per request): alpha[j], the probability that draft j is accepted
  given drafts 0..j-1 were. The expected tokens a step emits with k drafts is
  E(k) = 1 + sum_{i<k} prod_{j<=i} alpha[j]. A new request starts from the engine-wide
  estimate (`AcceptancePrior`, over all requests), which counts as `pseudo` = 2 of its own
  observations: a running mean over the first ones, then an exponential average over about
  10 (1 / weight). Noisy per-request estimates cost more than they adapt: two rejections in a
  row used to drop alpha[0] from 0.65 to 0.37 and the chain to 1-2 drafts where 3-4 paid
  (batch 1, trained pair: 0.9x the fixed K). A request's estimates drift back to the prior
  while it does not draft. The prior itself learns from every request's drafts the same way
  (a mean of the first, then over about 50). A position not drafted (by choice: the chain was
  shorter) drifts up towards the position before, 5% a step, in the request's estimate and in
  the prior, since the rule measures only what it drafts (`_explore`).
- `StepCosts` (one per engine): the verify step's time as a + b * n for n tokens in it, and the
  draft phase's as c + d * m + e * s + r * w for m draft steps, s drafts in all and w history
  rows written (robust fits to the latest timings: medians per verify size, the draft phases
  less outliers, re-calibrated when timings keep disagreeing, so a burst of slow steps cannot
  poison them for long; all requests draft together, so the draft steps cost d each however
  many requests draft, each draft e more, and each row of the drafter's history, e.g. MoA's
  LSA memory, r).

`choose_lengths` then maximises the batch's goodput, expected tokens per second,

    G(k_1..k_B) = sum_r E_r(k_r) /
        (a + b * sum_r (1 + k_r) + [m > 0] (c + d * m + e * s + r * w) + sum_{r drafts} X_r),
    m = max_r k_r, s = sum_r k_r, w = sum_{r drafts} E_r(k_r),

where X_r is what request r pays once to start drafting: the rows it skipped while it did not
draft (a prompt, a pause: r each), spread over the steps it has left, since they serve every
later step (a long generation repays a long prompt's rows; a request about to finish does not).

over k_r <= budget_r: for every candidate number of draft steps m in 0..K, each request takes
the drafts whose expected extra tokens beat their verify cost at the current goodput, up to m;
the best m wins. Plain decoding (m = 0) is one of the candidates, so a drafter that never
matches, or a load where extra verify tokens cost more than they return, ends at K = 0; then
`Probes` has one request draft its whole budget now and then, within 2% of the time, which
measures costs and acceptance again: a wrong belief is corrected within a bounded number of
explorations, whatever caused it.
`DraftGuard` checks the cost model by measurement: per batch size, its error on steps with and
without the rule's drafts (measured over predicted seconds) corrects the predicted gain, and
drafting is vetoed where the corrected gain is below 1 (and, from 8 requests on, where its
steps measured more seconds per emitted token than plain steps). The choice only decides how
many tokens are drafted; verification is unchanged, so outputs are exactly those of static
speculation (and of plain decoding, greedy).

`VLLM_MOA_ADAPTIVE=0` turns the rule off everywhere (fixed K), e.g. to compare drafting costs at
a fixed K.
"""

from __future__ import annotations

import math
import os
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from statistics import median

ADAPTIVE_ENV = "VLLM_MOA_ADAPTIVE"


def running_weight(floor: float, count: float) -> float:
    """The weight of the `count`-th observation (from 1) in an average that is the plain mean
    of the observations so far until that weighs each new one less than `floor`, then an
    exponential average over about 1 / floor of them: early observations neither dominate
    (as a first one taken at weight 1 would) nor fade at once."""
    return max(floor, 1.0 / count)


def adaptive_enabled() -> bool:
    return os.environ.get(ADAPTIVE_ENV, "1") != "0"


@dataclass
class AcceptancePrior:
    """The engine-wide acceptance per position, over all requests: where a new request's
    estimates start and where idle estimates drift back to."""

    k_max: int
    # Optimistic: positions never drafted look worth a try (then measured, and corrected).
    start: float = 0.8
    weight: float = 0.02  # of a new observation, in the long run (see `_update`)
    pseudo: float = 1.0  # the start counts as this many observations
    explore: float = 0.05  # per engine step, the pull of positions no request drafted (`_explore`)
    alpha: list[float] = field(default_factory=list)
    seen: list[float] = field(default_factory=list)  # observations per position (aged)
    deepest: int = 0  # the most drafts a request verified since the last `step`

    def __post_init__(self) -> None:
        self.alpha = self.alpha or [self.start] * self.k_max
        self.seen = self.seen or [0.0] * self.k_max

    def step(self) -> None:
        """Once per engine step: the positions no request drafted since the last call drift
        up towards the position before (`_explore`)."""
        _explore(self, self.deepest, self.explore)
        self.deepest = 0


def _update(est: AcceptancePrior | AcceptanceTracker, drafted: int, accepted: int) -> None:
    """One verify step's evidence into `est`: position j's estimate moves by 1 / (observations
    so far + the start's pseudo-count), never less than `weight` (a running mean of the first
    observations, then an exponential average over about 1 / weight of them)."""
    alpha, seen, floor, pseudo = est.alpha, est.seen, est.weight, est.pseudo + 1.0
    for j in range(min(drafted, accepted + 1, est.k_max)):  # none tested after a rejection
        w = max(floor, 1.0 / (seen[j] + pseudo))  # running_weight, inlined: a hot loop
        seen[j] += 1.0
        alpha[j] += w * ((1.0 if j < accepted else 0.0) - alpha[j])


def _explore(est: AcceptancePrior | AcceptanceTracker, drafted: int, rate: float) -> None:
    """Positions past the `drafted` ones (untested by choice, not after a rejection) whose
    estimate is below the position before drift up towards it by `rate`, and their evidence
    ages as they do. The rule only measures the positions it drafts: a few rejections in a
    row (a hard stretch of text at the start) used to pin position 2's estimate low for good,
    and the rule at 1 draft a step where 4 paid (batch 1, a well-trained pair: 0.88x the fixed
    K). Conditional acceptance along a chain is about flat for a trained drafter, so a stale
    estimate returns towards its predecessor's, is tried again, and is corrected by what the
    try measures (its aged evidence weighs little against it)."""
    for j in range(max(drafted, 1), est.k_max):
        gap = est.alpha[j - 1] - est.alpha[j]
        if gap > 0:
            est.alpha[j] += rate * gap
            est.seen[j] *= 1.0 - rate


@dataclass
class AcceptanceTracker:
    """Per-position conditional acceptance of one request's drafts (see the module docstring)."""

    k_max: int
    prior: AcceptancePrior | None = None  # shared by the engine's requests; own one if None
    weight: float = 0.1  # of a new observation, in the long run
    pseudo: float = 2.0  # the prior counts as this many of the request's own observations
    relax: float = 0.02  # per step without an observation, pull towards the prior
    explore: float = 0.05  # per step with drafts, the pull of positions not drafted (`_explore`)
    alpha: list[float] = field(default_factory=list)
    seen: list[float] = field(default_factory=list)  # observations per position (aged)
    # Steps without drafts not yet folded into alpha, and the gains of the alpha as it stands:
    # an idle request costs O(1) a step, which matters when a batch is decided every step.
    _idle: int = field(default=0, repr=False)
    _gains: list[float] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.prior is None:
            self.prior = AcceptancePrior(self.k_max)
        self.alpha = self.alpha or list(self.prior.alpha[: self.k_max])
        self.seen = self.seen or [0.0] * self.k_max

    def observe(self, drafted: int, accepted: int) -> None:
        """A verify step of `drafted` drafts that accepted the first `accepted`. Positions past
        the first rejection were not tested and keep their estimate; a step without drafts
        only relaxes the estimates towards the prior."""
        if drafted == 0:
            self._idle += 1
            return
        assert self.prior is not None
        self.settle()
        self._gains = None
        _update(self, drafted, accepted)
        _explore(self, drafted, self.explore)
        _update(self.prior, drafted, accepted)
        self.prior.deepest = max(self.prior.deepest, drafted)

    def settle(self, every: int = 1) -> list[float]:
        """Fold the idle steps into alpha once there are `every` of them (each pulls `relax` of
        the way to the prior; the prior's current value stands for its values over those
        steps) and return alpha."""
        if self._idle >= every:
            assert self.prior is not None
            keep = (1.0 - self.relax) ** self._idle
            self._idle = 0
            self._gains = None
            for j in range(self.k_max):
                p = self.prior.alpha[j]
                self.alpha[j] = p + keep * (self.alpha[j] - p)
                self.seen[j] *= keep  # the evidence ages as the estimate returns to the prior
        return self.alpha

    def first_bound(self) -> float:
        """An upper bound of the first draft's acceptance (and so of every draft's expected
        gain) without settling: idle steps only move alpha[0] towards the prior's."""
        assert self.prior is not None
        if not self._idle:
            return self.alpha[0]
        return max(self.alpha[0], self.prior.alpha[0])

    def gains(self, k: int) -> list[float]:
        """Expected extra tokens from each of the first k drafts: prod_{j<=i} alpha[j]. The
        idle steps are folded in 8 at a time (the pull is 2% a step: the choice is the same)."""
        self.settle(every=8)
        if self._gains is None:
            out, p = [], 1.0
            for a in self.alpha:
                p *= a
                out.append(p)
            self._gains = out
        return self._gains[:k]

    def expected_tokens(self, k: int) -> float:
        return 1.0 + sum(self.gains(k))


@dataclass
class StepCosts:
    """Step-cost model (seconds) from the engine's own timings: the verify step a + b * tokens,
    and the draft phase c + d * m + e * s + r * w for m draft steps, s drafts in all and w
    history rows written (everything a step with drafts costs beyond the verify step: for MoA
    the rows of the tokens just verified, and of those a request skipped while it did not
    draft, the draft steps over the drafting requests, bookkeeping; e is what makes drafting
    for a large batch cost more, r what makes a request that starts drafting after a long
    prompt or pause cost more).

    Noise cannot poison it for long: wall-clock timings on a shared machine come in bursts
    (compilation and first calls at start-up, another process, a page-in), and a belief that
    extra tokens cost five times a step once stopped drafting for the life of a server.
    - The verify line is fitted to the median of the latest `verify_window` timings of each
      step size (the `verify_sizes` sizes seen last): b is the weighted median of the slopes
      between the sizes' medians (Theil-Sen, each pair weighted by its distance), a the median
      of what b leaves of them. A burst shorter than half a window moves no median, and a
      longer one is forgotten once each size has been timed `verify_window` times more. Any two
      sizes identify b (the rule's explorations always time a second one, `Probes`); with one
      size, b is the prefill steps' cost per token (0 without any). b never exceeds what the
      steps timed say is possible: a step of n tokens costs at least n * b (a >= 0), and at
      most twice the prefill steps' median time per token.
    - The draft phase is fitted by least squares to the latest 2 / `forget` phases, less
      those whose time is off the fit's by more than `outlier` times the median ratio: a
      minority of slow phases is set aside at once, and a change that lasts is adopted once it
      is the majority. Each of e and r is fitted only once its regressor has varied apart from
      those before it (at batch 1, s = m), and the phase falls back to c + d * m, then to a mean
      ratio d, when m has not varied enough to tell, or a fit would need a negative
      coefficient. A coefficient the recent phases no longer identify keeps its last
      identified value: a load that holds the batch steady must not make a long prompt's rows
      (r) look free."""

    forget: float = 0.05  # the draft window is 2 / forget phases
    min_spread: float = 0.4  # std of m (s, w) below which d (e, r) is not identified
    # Draft phases not observed at first: a server's first one runs cold (first calls of the
    # compiled step, caches, pages of weights not yet touched). In a load sweep one such phase
    # (about 4x its cost, by the rule's log) made the rule stop drafting: the serving engines
    # skip one.
    cold_phases: int = 0
    verify_window: int = 9
    verify_sizes: int = 8
    outlier: float = 3.0
    # Re-calibration: `recalibrate_after` timings in a row off the current belief by more than
    # `disagree` times, the same way, replace it (the window keeps only them).
    recalibrate_after: int = 3
    disagree: float = 1.5
    recalibrations: int = 0  # (reported)
    _verify_off: dict[int, int] = field(default_factory=dict)
    _draft_off: int = 0
    # size -> its latest verify timings (most recently seen size last)
    _verify: dict[int, deque[float]] = field(default_factory=dict)
    _prefill: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=9))
    # The draft phases kept: regressors x = (1, m, s, w), seconds, and their products (the
    # upper triangle of x x^T, then x * seconds), summed in `_sums`.
    _phases: deque[tuple[tuple[float, ...], float, list[float]]] = field(default_factory=deque)
    _sums: list[float] = field(default_factory=lambda: [0.0] * 14)
    # Means over the phases kept (outliers set aside) of x x^T and of x * seconds.
    _xx: list[list[float]] = field(default_factory=lambda: [[0.0] * 4 for _ in range(4)])
    _xt: list[float] = field(default_factory=lambda: [0.0] * 4)
    base: float = 0.0  # a
    per_token: float = 0.0  # b
    draft_base: float = 0.0  # c
    draft_step: float = 0.0  # d
    draft_each: float = 0.0  # e
    draft_row: float = 0.0  # r
    _draft_phases: int = 0  # draft phases observed (or skipped as cold)
    draft_outliers: int = 0  # phases set aside at the last fit (reported)
    # The largest decode step kept and, from prefill / mixed steps, the median time per token
    # of a large step over the verify base (a bound on b, and b beyond the largest step).
    largest: float = 0.0
    prefill_per_token: float = 0.0

    def observe_verify(self, tokens: int, seconds: float) -> None:
        window = self._verify.pop(tokens, None)
        if window is None:
            window = deque(maxlen=self.verify_window)
        off = self._verify_off.get(tokens, 0)
        if len(window) >= self.recalibrate_after:
            off = disagreements(off, seconds / max(median(window), 1e-12), self.disagree)
        window.append(seconds)
        if abs(off) >= self.recalibrate_after:
            for _ in range(len(window) - self.recalibrate_after):
                window.popleft()
            off = 0
            self.recalibrations += 1
        self._verify_off[tokens] = off
        self._verify[tokens] = window  # re-inserted: the most recently seen size is last
        if len(self._verify) > self.verify_sizes:
            gone = next(iter(self._verify))
            del self._verify[gone]
            self._verify_off.pop(gone, None)
        self.largest = float(max(self._verify))
        self._fit_verify()

    def _fit_verify(self) -> None:
        medians = {n: median(w) for n, w in self._verify.items()}  # at most 9 timings each
        sizes = sorted(medians)
        if len(sizes) >= 2:
            slopes = [
                (
                    (medians[m] - medians[n]) / (m - n),
                    (m - n) * min(len(self._verify[n]), len(self._verify[m])),
                )
                for i, n in enumerate(sizes)
                for m in sizes[i + 1 :]
            ]
            b = _weighted_median(slopes)
        else:
            b = self.prefill_per_token
        bound = min(medians[n] / n for n in sizes if n > 0) if sizes[-1] > 0 else b
        if self.prefill_per_token:
            bound = min(bound, 2.0 * self.prefill_per_token)
        self.per_token = min(max(b, 0.0), bound)
        self.base = max(median([medians[n] - self.per_token * n for n in sizes]), 0.0)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """A step with prompt tokens (`tokens` in all): its time per token over the verify base
        bounds what a verify token costs beyond the decode steps seen (a fit over small decode
        steps can learn b as about 0 on a target that is compute-bound at a saturated batch's
        size), and bounds b itself. Before the decode steps identify b, it stands for b: a
        fresh server's first burst verifies K drafts for every request in every step, all of
        one size, and a b of 0 made those steps' cost look like a plain step's. The median of
        the latest few: a prefill during compilation is not the rule."""
        if tokens <= self.largest:
            return
        self._prefill.append((tokens, seconds))
        self.prefill_per_token = median([max(s - self.base, 0.0) / t for t, s in self._prefill])
        if self._verify:
            self._fit_verify()

    def verify_time(self, tokens: int) -> float:
        """The verify step's time for `tokens`: the fitted line up to the largest decode step
        seen, then at least the prefill steps' cost per token."""
        if tokens <= self.largest or not self.prefill_per_token:
            return self.base + self.per_token * tokens
        beyond = max(self.per_token, self.prefill_per_token) * (tokens - self.largest)
        return self.base + self.per_token * self.largest + beyond

    def observe_draft(
        self, steps: int, seconds: float, drafts: int | None = None, rows: int = 0
    ) -> None:
        """A draft phase of `steps` draft steps and `drafts` drafts over all requests (default:
        one request, drafts = steps) that wrote `rows` history rows and took `seconds`."""
        if steps <= 0:
            return
        self._draft_phases += 1
        if self._draft_phases <= self.cold_phases:
            return
        x = (1.0, float(steps), float(steps if drafts is None else drafts), float(rows))
        if len(self._phases) >= self.recalibrate_after:
            believed = self.draft_time(steps, int(x[2]), rows)
            self._draft_off = disagreements(
                self._draft_off, seconds / max(believed, 1e-12), self.disagree
            )
        products = [x[i] * x[j] for i in range(4) for j in range(i, 4)]
        products += [xi * seconds for xi in x]
        self._phases.append((x, seconds, products))
        self._sums = [s + p for s, p in zip(self._sums, products, strict=True)]
        keep = max(2, round(2.0 / self.forget))
        if abs(self._draft_off) >= self.recalibrate_after:
            keep = self.recalibrate_after
            self._draft_off = 0
            self.recalibrations += 1
        while len(self._phases) > keep:
            gone = self._phases.popleft()[2]
            self._sums = [s - p for s, p in zip(self._sums, gone, strict=True)]
        if not self._draft_phases % 1024:  # summed afresh now and then: no rounding drift
            self._sums = [sum(col) for col in zip(*(p for _, _, p in self._phases), strict=True)]
        self._moments(self._sums, len(self._phases))
        self._fit_draft()
        self.draft_outliers = 0
        if len(self._phases) < 6:
            return
        # Phases off the fit by more than `outlier` x the median ratio are set aside.
        c, d, e, r = self.draft_base, self.draft_step, self.draft_each, self.draft_row
        ratios = [s / max(c + d * x[1] + e * x[2] + r * x[3], 1e-12) for x, s, _ in self._phases]
        mid = median(ratios)
        low, high = mid / self.outlier, mid * self.outlier
        out = [p for p, q in zip(self._phases, ratios, strict=True) if not low <= q <= high]
        if out:
            self.draft_outliers = len(out)
            sums = list(self._sums)
            for _, _, products in out:
                sums = [s - p for s, p in zip(sums, products, strict=True)]
            self._moments(sums, len(self._phases) - len(out))
            self._fit_draft()

    def _moments(self, sums: list[float], count: int) -> None:
        """The means of x x^T and x * seconds from their sums over `count` phases."""
        xx = [[0.0] * 4 for _ in range(4)]
        k = 0
        for i in range(4):
            for j in range(i, 4):
                xx[i][j] = xx[j][i] = sums[k] / count
                k += 1
        self._xx, self._xt = xx, [s / count for s in sums[10:]]

    def _fit_draft(self) -> None:
        # The richest fit the data identify: (c, d, e, r), (c, d, r), (c, d, e), (c, d). A
        # coefficient left out keeps its last identified value (0 until it has one), and the
        # others are fitted to what it leaves of the time: a regressor that stops varying (a
        # steady load writes about the same rows every step) says nothing new about its
        # coefficient, not that it is 0 (which would make a long prompt's rows look free).
        held = {2: self.draft_each, 3: self.draft_row}
        for cols in ((0, 1, 2, 3), (0, 1, 3), (0, 1, 2), (0, 1)):
            if not self._identified(cols):
                continue
            fixed = {j: v for j, v in held.items() if j not in cols}
            fit = _least_squares(self._xx, self._residual(fixed), cols)
            if fit is not None and min(fit) >= -1e-12:  # a zero coefficient, up to rounding
                coef = {col: max(0.0, x) for col, x in zip(cols, fit, strict=True)}
                self.draft_base, self.draft_step = coef[0], coef[1]
                self.draft_each = coef.get(2, held[2])
                self.draft_row = coef.get(3, held[3])
                return
        self.draft_base = 0.0
        xt = self._residual(held)
        self.draft_step = max(xt[0], 0.0) / self._xx[0][1]  # mean time left / mean steps

    def _residual(self, fixed: dict[int, float]) -> list[float]:
        """The cross moments x * seconds of the draft phases less what the `fixed` coefficients
        (regressor index: value) explain."""
        return [self._xt[i] - sum(v * self._xx[i][j] for j, v in fixed.items()) for i in range(4)]

    def _identified(self, cols: tuple[int, ...]) -> bool:
        """Whether every regressor of `cols` after the constant varies apart from those before
        it by at least `min_spread` (the pivots of their covariance matrix, eliminated in
        order, are these conditional variances)."""
        xx, rest = self._xx, cols[1:]
        cov = [[xx[i][j] - xx[0][i] * xx[0][j] for j in rest] for i in rest]
        for p in range(len(rest)):
            if cov[p][p] < self.min_spread**2:
                return False
            for r in range(p + 1, len(rest)):
                factor = cov[r][p] / cov[p][p]
                for c in range(p, len(rest)):
                    cov[r][c] -= factor * cov[p][c]
        return True

    @property
    def known(self) -> bool:
        return bool(self._verify) and self._draft_phases > self.cold_phases

    def step_time(
        self, tokens: int, draft_steps: int, drafts: int | None = None, rows: float = 0.0
    ) -> float:
        """A step verifying `tokens` after `draft_steps` draft steps of `drafts` drafts in all
        (default: one request's, = draft_steps) that wrote `rows` history rows."""
        return self.verify_time(tokens) + self.draft_time(draft_steps, drafts, rows)

    def draft_time(self, steps: int, drafts: int | None = None, rows: float = 0.0) -> float:
        """A draft phase of `steps` draft steps (0: none, no cost) of `drafts` drafts in all
        (default: one request's, = steps) that writes `rows` history rows."""
        if not steps:
            return 0.0
        each = self.draft_each * (steps if drafts is None else drafts)
        return self.draft_base + self.draft_step * steps + each + self.draft_row * rows


def disagreements(count: int, ratio: float, factor: float) -> int:
    """The signed count of measurements in a row off a belief by more than `factor` times
    (positive: slower), after one more at `ratio` (measured over believed)."""
    if ratio > factor:
        return max(count, 0) + 1
    if ratio * factor < 1.0:
        return min(count, 0) - 1
    return 0


def _weighted_median(pairs: Sequence[tuple[float, float]]) -> float:
    """The median of (value, weight) pairs: the smallest value with half the weight at or
    below it (the mean of two values where the weight splits exactly between them)."""
    s = sorted(pairs)
    total = sum(w for _, w in s)
    acc = 0.0
    for i, (v, w) in enumerate(s):
        acc += w
        if acc > 0.5 * total + 1e-12:
            return v
        if abs(acc - 0.5 * total) <= 1e-12 and i + 1 < len(s):
            return 0.5 * (v + s[i + 1][0])
    return s[-1][0]


def _least_squares(
    xx: list[list[float]], xt: list[float], cols: tuple[int, ...]
) -> list[float] | None:
    """Solve the normal equations of the regressors `cols` (second moments xx, cross moments
    xt); None if singular."""
    size = len(cols)
    a = [[xx[i][j] for j in cols] for i in cols]
    b = [xt[i] for i in cols]
    for col in range(size):  # Gaussian elimination, partial pivoting
        pivot = max(range(col, size), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) < 1e-18:
            return None
        a[col], a[pivot], b[col], b[pivot] = a[pivot], a[col], b[pivot], b[col]
        for r in range(col + 1, size):
            factor = a[r][col] / a[col][col]
            b[r] -= factor * b[col]
            for c in range(col, size):
                a[r][c] -= factor * a[col][c]
    out = [0.0] * size
    for r in reversed(range(size)):
        out[r] = (b[r] - sum(a[r][c] * out[c] for c in range(r + 1, size))) / a[r][r]
    return out


def choose_lengths(
    trackers: list[AcceptanceTracker],
    budgets: list[int],
    costs: StepCosts,
    entry: list[float] | None = None,
) -> list[int]:
    """Drafts per request (0..budget) maximising expected tokens per second; see the module
    docstring. `entry`: seconds a request pays once if it drafts now (its history rows to
    catch up, spread over the steps it has left). Before the costs are known, every request
    drafts its budget (static K)."""
    return lengths_and_gain(trackers, budgets, costs, entry)[0]


def lengths_and_gain(
    trackers: list[AcceptanceTracker],
    budgets: list[int],
    costs: StepCosts,
    entry: list[float] | None = None,
) -> tuple[list[int], float]:
    """`choose_lengths`'s drafts and their predicted goodput over plain decoding's (infinite
    while the costs are unknown and every request drafts its budget)."""
    if not trackers:
        return [], 1.0
    if not costs.known:
        return list(budgets), float("inf")
    return _best_lengths(trackers, budgets, costs, entry or [0.0] * len(trackers))


def entry_costs(
    trackers: list[AcceptanceTracker],
    budgets: list[int],
    costs: StepCosts,
    catch_up: list[int],
    remaining: list[int],
) -> list[float]:
    """Each request's one-time cost of drafting now: its `catch_up` history rows (r each),
    spread over the steps it has left (`remaining` tokens at the tokens a step would give it):
    the rows serve every later step too, so a long generation repays them and a request about
    to finish does not. Exact for a request that may draft; for one that cannot (`_best_lengths`'
    first test: its first draft's bound must beat the floor plus its entry at plain decoding's
    goodput) a lower bound that already rules it out (at most one token a step: entry >=
    r * c / left), so a batch of requests that do not draft costs O(1) each."""
    out = []
    n = len(trackers)
    plain_rate = n / max(costs.step_time(n, 0), 1e-12)
    floor = plain_rate * (costs.per_token + costs.draft_each)  # `_best_lengths`' first threshold
    for t, b, c, left in zip(trackers, budgets, catch_up, remaining, strict=True):
        least = costs.draft_row * c / max(left, 1)
        if not b or not c or t.first_bound() <= floor + plain_rate * least:
            out.append(least)
            continue
        steps = max(1.0, left / t.expected_tokens(b))
        out.append(costs.draft_row * c / steps)
    return out


PROBE_EVERY = 32  # steps between explorations, at most as often


@dataclass
class Probes:
    """Exploration that always recovers: while the rule drafts nothing at all, every `every`
    steps one request drafts its whole budget anyway, so that the verify cost's slope (a step
    of K more tokens than a plain one), the draft phase's cost and the acceptance are measured
    again, whatever made the rule stop (a useless drafter, a heavy load, or a burst of slow
    timings that a lasting belief would never correct). Their measured cost (`spent`) is kept
    within `share` of the time the engine spends in steps without drafts (each step's
    `step_time`: the engine's own time, so idle time or other work in the process earns no
    explorations), so a drafter that never pays costs plain decoding at most that share, as
    long as an exploration costs at most `share` x `max_wait` plain steps (2.5 here; beyond that
    one every `max_wait` steps).

    Bounded recovery: an exploration comes at least every `max_wait` steps (every `every` at a
    normal exploration's cost), and each one times a verify step of its own size and a draft
    phase of K steps. `StepCosts` keeps medians of the latest `verify_window` timings per size
    and fits the draft phase to its latest phases less outliers, and re-calibrates both after
    `recalibrate_after` timings in a row that disagree with them (`DraftGuard` its errors
    likewise): a wrong belief, however it was formed, is replaced by current timings after 3
    explorations, and the rule drafts again where drafting pays (about 300 steps after a burst
    of 5x-slow steps, `tests/test_adaptive_recovery.py`). The
    explored request is the one whose exploration costs least (`catch_up`: e.g. the history
    rows a drafter must first write for it, since it last drafted); its acceptance also moves
    the engine-wide prior, so one request an exploration is enough, and a batch never pays
    every request's catch-up at once."""

    every: int = PROBE_EVERY
    steps: int = 0
    due: int = PROBE_EVERY
    share: float = 0.02
    allowance: float = 0.0  # seconds of exploring earned (share x step time) minus spent
    probing: bool = False  # the last `apply` chose an exploration
    count: int = 0  # explorations so far (reported)
    # However much an exploration cost, the next comes within this many steps: one measured
    # during a burst (5x its cost) otherwise put off the next by 5x, and recovery with it.
    max_wait: int = 4 * PROBE_EVERY
    _step_time: float = 0.0  # the last step's (plain) time

    def apply(
        self,
        ks: list[int],
        budgets: list[int],
        catch_up: list[int] | None = None,
        step_time: float = 0.0,
    ) -> list[int]:
        self.steps += 1
        self.probing = False
        if any(ks):
            return ks
        self.allowance += self.share * step_time
        self._step_time = step_time
        if self.steps < self.due or not any(budgets) or self.allowance < 0:
            return ks
        self.due = self.steps + self.every
        self.probing = True
        self.count += 1
        cost = catch_up if catch_up is not None else [0] * len(budgets)
        chosen = min((c, i) for i, (c, b) in enumerate(zip(cost, budgets, strict=True)) if b)[1]
        return [b if i == chosen else 0 for i, b in enumerate(budgets)]

    def spent(self, seconds: float) -> None:
        """The exploration just made cost `seconds` (beyond a plain step): the next waits until
        the steps since have earned it back, or `max_wait` steps have passed."""
        debt = self.share * self.max_wait * self._step_time
        self.allowance = max(min(self.allowance, 0.0) - seconds, -debt)


def batch_bucket(batch: int) -> int:
    """The guard's batch-size classes: each size up to 16, then 8 per doubling (about 9% wide),
    so a class's steps cost about the same per token."""
    if batch <= 16:
        return batch
    return 16 + round(8 * math.log2(batch / 16))


@dataclass
class _Arms:
    """One batch-size class's measurements: per arm (0: no drafts, 1: the rule's drafts), the
    exponential averages of a step's measured seconds and of the cost model's prediction for
    it, their count, and the guard's decisions since the arm was last measured."""

    seconds: list[float] = field(default_factory=lambda: [0.0, 0.0])
    predicted: list[float] = field(default_factory=lambda: [0.0, 0.0])
    tokens: list[float] = field(default_factory=lambda: [0.0, 0.0])
    seen: list[int] = field(default_factory=lambda: [0, 0])
    since: list[int] = field(default_factory=lambda: [0, 0])
    off: list[int] = field(default_factory=lambda: [0, 0])  # `disagreements` with the error

    def error(self, arm: int) -> float:
        """Measured over predicted seconds: the cost model's error for the arm's steps."""
        return self.seconds[arm] / max(self.predicted[arm], 1e-12)

    def per_token(self, arm: int) -> float:
        """Measured seconds per emitted token of the arm's steps."""
        return self.seconds[arm] / max(self.tokens[arm], 1e-12)


@dataclass
class DraftGuard:
    """A measured check on the cost model. The rule's predicted gain is only as good as its
    step-cost model, a line fitted over a wide range of step sizes from noisy timings: at
    saturation a few percent of error decided close calls wrongly (0.90x plain on a
    compute-bound CPU), and a fresh server's first burst, verifying K drafts for every request
    in every step, never shows a plain step's time, so the model can be far off (0.78x). For
    the batch-size class of each step (`batch_bucket`), the guard measures the model's error
    on the steps that drafted (the rule's choice: the verify and the draft phase before it)
    and on those that did not: measured over predicted seconds, rho_1 and rho_0. The rule's
    gain corrected by them, gain * rho_0 / rho_1, decides: drafting is vetoed where it is below
    1. Acceptance is not re-measured here: the rule's expected tokens come from the requests'
    trackers, and the seconds per emitted token of a few steps confuse a streak of one
    request's rejections with cost (at batch 1 such a guard cost 7% against the fixed K).

    Until the drafting arm has `min_seen` measurements the rule is followed, then the plain
    arm is measured as many times (plain steps cost no more than plain decoding); afterwards a
    vetoed arm is re-measured once every `retest` vetoes, and on close calls (corrected gain
    below 1 + `margin`) the plain arm once every `retest` drafting steps, so a change of
    traffic is followed. The guard only removes drafts, so outputs stay those of static
    speculation.

    From `goodput_batch` requests on, drafting is also vetoed where its steps measured more
    seconds per emitted token than plain steps (the earlier guard's check): over that many
    requests a step's emitted tokens average out the acceptance streaks, and at saturation the
    model check alone drafted where the direct comparison did not (0.93x plain against 1.00x
    in the interleaved load sweep, after the lower rates had moved the cost model)."""

    enabled: bool = True  # off: the rule decides alone (an injected cost model, in tests)
    goodput_batch: int = 8
    margin: float = 0.25
    min_seen: int = 3
    retest: int = 16
    weight: float = 0.25  # of a new measurement in an arm's averages, in the long run
    arms: dict[int, _Arms] = field(default_factory=dict)
    pending: tuple[int, int] | None = None  # (class, arm) of the last decision, not yet measured
    vetoed: int = 0  # decisions against the rule's drafts (reported)
    # An arm whose error is measured `recalibrate_after` times in a row off its average by
    # more than `disagree` times, the same way, starts again from them (a burst of slow steps
    # once kept drafting vetoed for 700 steps, in `tests/test_adaptive_recovery.py`).
    recalibrate_after: int = 3
    disagree: float = 1.5
    recalibrations: int = 0  # (reported)

    def decide(self, batch: int, drafting: bool, gain: float) -> bool:
        """Whether the step drafts as the rule chose (`drafting`, predicted `gain` = goodput over
        plain decoding's). Every decision waits for `observe` of the step that verifies it."""
        if not self.enabled:
            return drafting
        key = batch_bucket(batch)
        arm = int(drafting)
        if drafting:
            a = self.arms.setdefault(key, _Arms())
            a.since[0] += 1
            a.since[1] += 1
            if a.seen[1] < self.min_seen:
                arm = 1  # the rule's choice, until its error is measured
            elif a.seen[0] < self.min_seen:
                arm = 0  # then plain steps' error, whatever the predicted gain
            else:
                corrected = gain * a.error(0) / a.error(1)
                slower = key >= self.goodput_batch and a.per_token(1) > a.per_token(0)
                if corrected < 1.0 or slower:  # no drafts but a re-measurement now and then
                    arm = int(a.since[1] > self.retest)
                else:  # faster: draft, but for a re-measurement of plain steps on close calls
                    arm = int(not (corrected < 1.0 + self.margin and a.since[0] > self.retest))
            self.vetoed += 1 - arm
        self.pending = (key, arm)
        return bool(arm)

    def observe(self, batch: int, seconds: float, predicted: float, tokens: int) -> None:
        """The step that verified the last decision took `seconds` (its verify and the draft
        phase before it) where the cost model, before it learnt from this step, predicted
        `predicted`, and emitted `tokens`. Steps whose batch changed class (requests joined or
        left) are not counted."""
        if self.pending is None:
            return
        key, arm = self.pending
        self.pending = None
        if batch_bucket(batch) != key or predicted <= 0:
            return
        a = self.arms.setdefault(key, _Arms())
        if a.seen[arm]:  # re-calibrated after `recalibrate_after` errors in a row off its own
            ratio = seconds / predicted / a.error(arm)
            a.off[arm] = disagreements(a.off[arm], ratio, self.disagree)
            if abs(a.off[arm]) >= self.recalibrate_after:
                a.seen[arm] = a.off[arm] = 0
                self.recalibrations += 1
        w = running_weight(self.weight, a.seen[arm] + 1)
        a.seconds[arm] += w * (seconds - a.seconds[arm])
        a.predicted[arm] += w * (predicted - a.predicted[arm])
        a.tokens[arm] += w * (tokens - a.tokens[arm])
        a.seen[arm] += 1
        a.since[arm] = 0

    def skip(self) -> None:
        """The last decision will not be measured (a probe, or the step is not like others)."""
        self.pending = None


@dataclass
class AdaptiveLengths:
    """What adaptive speculation keeps for one engine (standalone or in vLLM): its cost model,
    the acceptance prior its requests start from, the probes, and how many request-steps chose
    each length (`chosen[k]`, reported in the stats / logs)."""

    k_max: int
    costs: StepCosts = field(default_factory=StepCosts)
    probes: Probes = field(default_factory=Probes)
    guard: DraftGuard = field(default_factory=DraftGuard)
    prior: AcceptancePrior | None = None
    chosen: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.prior = self.prior or AcceptancePrior(self.k_max)
        self.chosen = self.chosen or [0] * (self.k_max + 1)

    def tracker(self) -> AcceptanceTracker:
        """A new request's tracker, starting from the prior."""
        return AcceptanceTracker(self.k_max, self.prior)

    def choose(
        self,
        trackers: list[AcceptanceTracker],
        budgets: list[int],
        catch_up: list[int] | None = None,
        remaining: list[int] | None = None,
        batch: int | None = None,
    ) -> list[int]:
        """Drafts per request this step: the goodput rule, checked by the guard, or a probe
        while it drafts nothing. `catch_up`: history rows each request must write before it
        drafts beyond a step's own (0 when it drafted the step before);
        `remaining`: tokens each may still generate; `batch`: the step's requests (default: one
        per tracker), the guard's batch-size class."""
        if not trackers:
            return []
        assert self.prior is not None
        self.prior.step()
        entry = None
        if catch_up is not None and remaining is not None and self.costs.known:
            entry = entry_costs(trackers, budgets, self.costs, catch_up, remaining)
        ks, gain = lengths_and_gain(trackers, budgets, self.costs, entry)
        if not self.guard.decide(batch or len(budgets), any(ks), gain):
            ks = [0] * len(ks)
        step = self.costs.step_time(len(budgets), 0) if self.costs.known else 0.0
        ks = self.probes.apply(ks, budgets, catch_up, step)
        if self.probes.probing:
            self.guard.skip()
        for k in ks:
            self.chosen[k] += 1
        return ks

    def choose_steps(self, trackers: list[AcceptanceTracker], k: int, verify_tokens: int) -> int:
        """Draft steps for the whole batch where every request verifies `k` slots whatever is
        drafted (vLLM's V2 runner schedules them before the drafts exist; slots past the drafts
        hold padding): the m of `best_draft_steps`, `k` until the costs are known, and a probe
        (one step) now and then while it drafts nothing. `verify_tokens`: the next verify
        step's tokens. No guard: a wrong verify-time estimate scales every m's cost alike."""
        if not trackers or k <= 0:
            return 0
        assert self.prior is not None
        self.prior.step()
        n = len(trackers)
        verify = self.costs.verify_time(verify_tokens) if self.costs.known else 0.0
        m = best_draft_steps(trackers, k, verify, self.costs)[0] if self.costs.known else k
        m = max(self.probes.apply([m] * n, [k] * n, None, verify))
        self.chosen[m] += n
        return m

    def observe_step(self, batch: int, seconds: float, predicted: float, tokens: int) -> None:
        """The step that verified the last `choose`, of `batch` requests: `seconds` for its
        verify and the draft phase before it, what the cost model predicted for them before it
        learnt from this step, and the `tokens` it emitted (for the guard)."""
        self.guard.observe(batch, seconds, predicted, tokens)

    def summary(self) -> str:
        total = max(sum(self.chosen), 1)
        shares = [round(c / total, 3) for c in self.chosen]
        mean = sum(k * c for k, c in enumerate(self.chosen)) / total
        c = self.costs
        return (
            f"drafts per request-step {shares} (0..{self.k_max}), mean {mean:.2f}; drafting "
            f"{1e3 * c.draft_base:.2f} ms + {1e3 * c.draft_step:.2f} ms per step + "
            f"{1e3 * c.draft_each:.3f} ms per draft, target step "
            f"{1e3 * c.base:.2f} ms + {1e3 * c.per_token:.3f} ms per token (medians of "
            f"{len(c._verify)} step sizes; draft phases set aside as outliers "
            f"{c.draft_outliers}; re-calibrations {c.recalibrations + self.guard.recalibrations}"
            f"); explorations {self.probes.count}; steps whose drafts were vetoed by measurement "
            f"{self.guard.vetoed}"
        )


@dataclass
class OneRequest:
    """Adaptive lengths cycle by cycle for a request decoded on its own (the standalone engine,
    the client-server client): the engine's `AdaptiveLengths` and the request's tracker. Each
    cycle `choose` the drafts, run the cycle, then `observe` it; the cost model's own
    measurements (verify and draft phases) are the caller's, which knows what they cover."""

    lengths: AdaptiveLengths
    tracker: AcceptanceTracker
    predicted: float = 0.0  # the cost model's prediction of the cycle chosen last (the guard's)
    chose: bool = False  # the cycle under way was chosen by the rule (the guard measures it)

    @classmethod
    def of(cls, lengths: AdaptiveLengths) -> OneRequest:
        return cls(lengths, lengths.tracker())

    def choose(self, budget: int, catch_up: int = 0, remaining: int | None = None) -> int:
        """Drafts for the next cycle (0..budget). `catch_up`: history rows the proposer must
        write before it drafts; `remaining`: tokens the request may still generate (without
        it, entry costs are not counted)."""
        extra = ([catch_up], [remaining]) if remaining is not None else (None, None)
        k = self.lengths.choose([self.tracker], [budget], *extra)[0]
        # The cycle's time as the cost model predicts it: with drafts, the rows it writes are
        # the backlog and about the tokens it emits.
        costs = self.lengths.costs
        rows = catch_up + self.tracker.expected_tokens(k)
        self.predicted = costs.step_time(k + 1 if k else 1, k, k, rows) if costs.known else 0.0
        self.chose = True
        return k

    def observe(
        self, drafted: int, accepted: int, seconds: float, probe_cost: float | None = None
    ) -> None:
        """The cycle just run: `drafted` drafts (a proposer may draft fewer than asked), of
        which `accepted` were accepted, in `seconds` (the whole cycle, for the guard, if the
        rule chose it); `probe_cost`: what its draft phase cost beyond a plain step, charged to
        the probes if the rule chose a probe."""
        self.tracker.observe(drafted, accepted)
        if self.chose:
            self.lengths.observe_step(1, seconds, self.predicted, accepted + 1)
            self.chose = False
            if probe_cost is not None and self.lengths.probes.probing:
                self.lengths.probes.spent(probe_cost)


def best_draft_steps(
    trackers: list[AcceptanceTracker], k: int, verify: float, costs: StepCosts
) -> tuple[int, float]:
    """The number of draft steps m (0..k) for a batch whose requests each verify k slots
    whatever is drafted (vLLM's V2 runner): m maximises the expected tokens per second,
    sum_r E_r(m) / (verify + c + d * m + e * B * m), `verify` being the verify step's seconds
    (the same for every m). Returns m and its rate over drafting nothing (1.0 at m = 0). A
    useless drafter (E_r(m) about 1) ends at 0: the slots are still verified, but no draft
    step is paid."""
    n = len(trackers)
    plain = best = n / max(verify, 1e-12)
    best_m = 0
    # The batch's expected extra tokens from draft j, summed once per depth (O(batch * k)):
    # E(m) = n + sum_{j < m} depth[j].
    depth = [0.0] * k
    for t in trackers:
        for j, g in enumerate(t.gains(k)):
            depth[j] += g
    expected = float(n)
    for m in range(1, k + 1):
        expected += depth[m - 1]
        rate = expected / max(verify + costs.draft_time(m, n * m), 1e-12)
        if rate > best * (1.0 + 1e-9):
            best_m, best = m, rate
    return best_m, best / plain


def _best_lengths(
    trackers: list[AcceptanceTracker], budgets: list[int], costs: StepCosts, entry: list[float]
) -> tuple[list[int], float]:
    """The drafts per request and their predicted goodput over plain decoding's (1.0 when
    nothing is drafted). One pass per number of draft steps m = 1, 2, ..., K: every request
    takes its leading drafts (up to m) whose expected tokens beat their verify cost at the best
    goodput so far (the first also its entry cost; a lower bound of the optimum's goodput, so
    the rule errs towards drafting); the best m wins (a fixed draft-phase cost can make m = 1
    lose and m = 3 win, so every m is tried, until no request takes draft m). A drafting request
    writes the history rows of the tokens it gets (about its expected tokens: `draft_row` each).
    Per-depth totals make each m O(K); O(batch * K) each time the best goodput rises."""
    n_req = len(trackers)
    best_rate = plain_rate = n_req / max(costs.step_time(n_req, 0), 1e-12)
    per_draft = costs.per_token + costs.draft_each
    # The threshold only rises with the best rate, and no draft gains more than the first's
    # acceptance: a request whose bound is below the first threshold never drafts.
    floor = best_rate * per_draft
    candidates = [
        (i, t.gains(b))
        for i, (t, b) in enumerate(zip(trackers, budgets, strict=True))
        if b and t.first_bound() > floor + best_rate * entry[i]
    ]
    ks = [0] * n_req
    if not candidates:
        return ks, 1.0
    depth = max(len(g) for _, g in candidates)
    best_m, best_lengths = 0, []
    threshold = -1.0
    for m in range(1, depth + 1):
        if best_rate * per_draft != threshold:  # (re)take the drafts that pay at this rate
            threshold = best_rate * per_draft
            lengths = [_take_while(g, threshold, best_rate * entry[i]) for i, g in candidates]
            taking = [0] * (depth + 1)  # requests that take draft j
            gained = [0.0] * (depth + 1)  # their expected extra tokens from it
            for n, (_, g) in zip(lengths, candidates, strict=True):
                for j in range(n):
                    taking[j + 1] += 1
                    gained[j + 1] += g[j]
            # what the requests that draft pay once (entry) and their rows of a step (1 each)
            entering = sum(entry[i] for n, (i, _) in zip(lengths, candidates, strict=True) if n)
        if not taking[m]:  # nobody takes draft m: deeper steps cannot pay either
            break
        drafts = sum(taking[1 : m + 1])
        extra = sum(gained[1 : m + 1])
        expected = n_req + extra
        rows = taking[1] + extra  # each drafting request's verified tokens
        step = costs.step_time(n_req + drafts, m, drafts, rows) + entering
        rate = expected / max(step, 1e-12)
        if rate > best_rate * (1.0 + 1e-9):
            best_rate, best_m, best_lengths = rate, m, lengths
    if best_m:
        for (i, _), n in zip(candidates, best_lengths, strict=True):
            ks[i] = min(n, best_m)
    return ks, best_rate / plain_rate


def _take_while(gains: list[float], threshold: float, first: float = 0.0) -> int:
    """How many leading drafts each return more expected tokens than `threshold` costs (the
    first also `first` more: the request's entry cost)."""
    k = 0
    for g in gains:
        if g <= threshold + (first if k == 0 else 0.0):
            break
        k += 1
    return k
