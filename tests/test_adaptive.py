"""Adaptive speculation length (vllm_moa/adaptive.py): the estimates, the goodput rule on
synthetic costs, and the standalone engine's decisions with drafters that never / always match
(outputs identical to plain decoding in both)."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import AlternatingCosts, OracleMoAProposer, make_drafter

from tests.costs import fixed_costs
from vllm_moa.adaptive import (
    PROBE_EVERY,
    AcceptanceTracker,
    AdaptiveLengths,
    DraftGuard,
    Probes,
    StepCosts,
    _best_lengths,
    batch_bucket,
    choose_lengths,
)
from vllm_moa.decoding import SpeculativeEngine
from vllm_moa.drafters.moa.proposer import MoAProposer

K = 4


@pytest.fixture(autouse=True)
def adaptive_allowed(monkeypatch):
    """The default mode, said explicitly: this module tests the adaptive rule itself."""
    monkeypatch.setenv("VLLM_MOA_ADAPTIVE", "1")


def costs(base=1.0, per_token=0.02, draft_step=0.1, spread=True) -> StepCosts:
    """Costs observed from steps of several sizes (so the per-token cost is identified)."""
    c = StepCosts(forget=0.2)
    for n in (1, 5, 9, 3, 7) if spread else (5,) * 5:
        c.observe_verify(n, base + per_token * n)
    c.observe_draft(4, 4 * draft_step)
    return c


def test_cost_model_recovers_a_linear_step_time():
    c = costs(base=2.0, per_token=0.5, draft_step=0.3)
    assert c.base == pytest.approx(2.0) and c.per_token == pytest.approx(0.5)
    assert c.draft_step == pytest.approx(0.3)
    flat = costs(base=2.0, per_token=0.5, spread=False)
    assert flat.per_token == 0.0 and flat.base == pytest.approx(4.5)  # b not identified yet


def test_a_cold_first_draft_phase_does_not_stop_drafting():
    """A server's first draft phase can run cold (in a load sweep the rule's log put a draft
    step at about 4x its cost from the start): taken as the model's whole draft cost it made
    the rule stop drafting for the whole run, and the rule learns draft
    costs only from phases it chooses (probes, one token, now and then). The serving engines
    skip one cold phase, and an early phase measured too slow weighs as one of the phases so
    far, so the next phase halves its error."""
    trackers = [AcceptanceTracker(K, alpha=[0.7, 0.5, 0.4, 0.3])]

    def after(phases: list[float], cold: int) -> StepCosts:
        c = StepCosts(cold_phases=cold)
        for n in (1, 2, 3, 1, 2, 3):
            c.observe_verify(n, 0.030 + 0.002 * n)
        for seconds in phases:
            c.observe_draft(1, seconds)
        return c

    slow, normal = 0.160, 0.006
    skipped = after([slow, normal], cold=1)
    assert skipped.draft_step == pytest.approx(normal)
    assert choose_lengths(trackers, [K], skipped)[0] >= 2
    averaged = after([slow, normal], cold=0)  # a slow phase observed: the mean of the two
    assert averaged.draft_step == pytest.approx((slow + normal) / 2)
    for _ in range(28):  # probes at the normal cost: as 1/n (was: by 5% a probe, 0.041 now)
        averaged.observe_draft(1, normal)
    assert averaged.draft_step < 0.012
    assert choose_lengths(trackers, [K], averaged)[0] >= 1
    assert not StepCosts(cold_phases=1).known


def test_draft_phase_cost_has_a_fixed_part_and_a_per_step_part():
    c = StepCosts(forget=0.2)
    assert c.draft_base == 0.0
    c.observe_draft(4, 0.5 + 4 * 0.1)
    assert c.draft_base == 0.0 and c.draft_step == pytest.approx(0.9 / 4)  # one size: a ratio
    for m in (1, 3, 2, 4, 1, 2):
        c.observe_draft(m, 0.5 + m * 0.1)
    assert c.draft_base == pytest.approx(0.5) and c.draft_step == pytest.approx(0.1)
    assert c.step_time(3, 2) == pytest.approx(c.base + c.per_token * 3 + 0.7)
    assert c.step_time(3, 0) == pytest.approx(c.base + c.per_token * 3)


def test_draft_phase_cost_grows_with_the_drafts_of_a_batch():
    """c + d * m + e * s recovered from steps of several batch sizes; at batch 1 (s = m) the
    fit stays stable and predicts batch-1 steps."""
    c = StepCosts(forget=0.1)
    for batch in (1, 4, 16, 2, 8):
        for m in (1, 3, 2, 4):
            c.observe_draft(m, 0.5 + 0.1 * m + 0.02 * m * batch, m * batch)
    assert (c.draft_base, c.draft_step, c.draft_each) == pytest.approx((0.5, 0.1, 0.02), rel=1e-3)
    assert c.step_time(0, 2, 32) - c.base == pytest.approx(0.5 + 0.2 + 0.64, rel=1e-3)
    one = StepCosts(forget=0.1)
    for m in (1, 3, 2, 4) * 3:
        one.observe_draft(m, 0.5 + 0.12 * m)
    assert one.step_time(0, 3) - one.base == pytest.approx(0.5 + 0.36, rel=1e-3)


def test_draft_phase_cost_separates_the_history_rows_written():
    """c + d * m + e * s + r * w recovered when the rows written vary apart from the drafts
    (requests that catch up on a prompt or a pause); without such variation r stays 0 and the
    rows' cost is absorbed by the other terms, as before."""
    c = StepCosts(forget=0.1)
    for batch, rows in ((1, 3), (4, 200), (16, 20), (2, 90), (8, 12), (4, 5)):
        for m in (1, 3, 2, 4):
            s = m * batch
            c.observe_draft(m, 0.5 + 0.1 * m + 0.02 * s + 0.001 * rows, s, rows)
    assert (c.draft_base, c.draft_step, c.draft_each, c.draft_row) == pytest.approx(
        (0.5, 0.1, 0.02, 0.001), rel=1e-3
    )
    assert c.step_time(0, 2, 8, rows=100) - c.base == pytest.approx(0.5 + 0.2 + 0.16 + 0.1)
    flat = StepCosts(forget=0.1)
    for m in (1, 3, 2, 4) * 3:
        flat.observe_draft(m, 0.5 + 0.12 * m, m, 5)
    assert flat.draft_row == 0.0 and flat.step_time(0, 3) - flat.base == pytest.approx(0.86)


def test_a_cost_the_steps_stop_identifying_keeps_its_last_value():
    """A steady load (the same batch size, the same rows written every step) says nothing new
    about b or r: they keep their identified values instead of dropping to 0, which made extra
    verify tokens and a burst of prompts' rows look free (the rule then drafted at saturation
    and paid a whole burst's catch-up at once)."""
    c = costs(base=1.0, per_token=0.5, draft_step=0.1)
    for _ in range(60):  # 16 requests, one token each, long enough to forget the spread
        c.observe_verify(16, 1.0 + 0.5 * 16)
    assert c.per_token == pytest.approx(0.5) and c.base == pytest.approx(1.0)
    c = StepCosts(forget=0.2)
    for batch, rows in ((1, 3), (4, 200), (16, 20), (2, 90), (8, 12), (4, 5)):
        for m in (1, 3, 2, 4):
            c.observe_draft(m, 0.5 + 0.1 * m + 0.02 * m * batch + 0.001 * rows, m * batch, rows)
    for _ in range(60):  # then every phase drafts 2 steps for 8 requests and writes 16 rows
        c.observe_draft(2, 0.5 + 0.2 + 0.02 * 16 + 0.001 * 16, 16, 16)
    assert not c._identified((0, 1))  # the steady phases identify nothing any more
    assert c.draft_row == pytest.approx(0.001, rel=1e-6)
    assert c.draft_each == pytest.approx(0.02, rel=1e-6)
    assert c.step_time(0, 2, 16, rows=2000) - c.base == pytest.approx(0.5 + 0.2 + 0.32 + 2.0)


def test_prefill_steps_bound_the_verify_cost_beyond_the_decode_steps_seen():
    """Decode steps of 1-6 tokens that barely move the time (b fitted about 0) say nothing of a
    32-token step; a 2,000-token prompt step at 1.8 ms per token over the base does: beyond
    the largest decode step seen, each token costs at least that."""
    c = StepCosts()
    for n in (1, 2, 4, 6, 3, 5) * 4:
        c.observe_verify(n, 0.026 + 0.0001 * n)
    assert c.per_token < 0.0002 and c.largest == pytest.approx(6, rel=0.05)
    assert c.verify_time(32) == pytest.approx(0.026 + 0.0001 * 32, rel=1e-3)  # no prefill yet
    c.observe_prefill(4, 1.0)  # not beyond the decode steps seen: ignored
    c.observe_prefill(2000, 0.026 + 2000 * 0.0018)
    assert c.prefill_per_token == pytest.approx(0.0018, rel=1e-2)
    assert c.verify_time(4) == pytest.approx(0.026 + 0.0001 * 4, rel=1e-3)
    expected = c.base + c.per_token * c.largest + 0.0018 * (32 - c.largest)
    assert c.verify_time(32) == pytest.approx(expected, rel=1e-2)
    assert c.step_time(32, 0) == c.verify_time(32)


def test_a_first_burst_costs_its_verify_tokens_at_the_prefill_rate_until_b_is_identified():
    """A fresh server's first burst (traced on the CPU pair): a 1,879-token prefill in 2.8 s,
    then every step verifies K=4 drafts for all 16 requests (80 tokens, 127 ms): steps of one
    size never identify b, and with b = 0 the rule put a plain step at 127 ms too and drafted
    on. The prefill's time per token stands for b until the decode steps identify it, so a
    plain step is put at about 32 ms and drafts at this acceptance stop."""
    c = StepCosts()
    c.observe_prefill(1879, 2.8)
    for _ in range(3):
        c.observe_verify(80, 0.127)
    c.observe_draft(4, 0.040, 64, 0)
    assert c.per_token == pytest.approx(2.8 / 1879) and c.verify_time(16) < 0.035
    burst = [AcceptanceTracker(K, alpha=[0.5, 0.23, 0.17, 0.08]) for _ in range(16)]
    assert choose_lengths(burst, [K] * 16, c) == [0] * 16
    for n in (16, 17, 16, 18, 16, 20) * 5:  # plain steps and a few drafts: b identified
        c.observe_verify(n, 0.035 + 0.00115 * n)
    assert c.per_token == pytest.approx(0.00115, rel=0.05)


def test_a_long_catch_up_is_paid_only_where_the_steps_left_repay_it():
    """Two requests that would draft: the one with 500 history rows to write first (e.g. its
    prompt, 1 ms each) starts drafting only when it has enough tokens left to repay them."""
    c = costs(base=1.0, per_token=0.001, draft_step=0.01)
    for m, rows in ((1, 2), (4, 300), (2, 3), (3, 120), (1, 40)):
        c.observe_draft(m, 0.01 * m + 0.001 * rows, m, rows)
    assert c.draft_row == pytest.approx(0.001)
    good = AcceptanceTracker(K, alpha=[0.8] * K)
    lengths = AdaptiveLengths(K, c)
    few = lengths.choose([good, good], [K, K], catch_up=[0, 500], remaining=[3, 3])
    many = lengths.choose([good, good], [K, K], catch_up=[0, 500], remaining=[3000, 3000])
    assert few[0] == K and few[1] == 0
    assert many == [K, K]


def test_rule_looks_past_a_first_draft_that_does_not_pay_for_the_fixed_cost():
    """With a draft phase of 1.0 + 0.05 per step on a verify step of 1.0, one good draft does
    not pay (1.9 tokens for 2.05) but four do (4.4 tokens for 2.2)."""
    c = StepCosts()
    c.observe_verify(1, 1.0)
    for m in (1, 4, 2, 3):
        c.observe_draft(m, 1.0 + 0.05 * m)
    t = AcceptanceTracker(K)
    t.alpha = [0.9] * K
    assert choose_lengths([t], [K], c) == [K]


def test_tracker_learns_per_position_acceptance():
    never, always = AcceptanceTracker(K), AcceptanceTracker(K)
    # The first observations move the estimate most (the prior counts as `pseudo` of them).
    never.observe(K, 0)
    assert never.alpha[0] == pytest.approx(0.8 * (1 - 1 / (never.pseudo + 1)))
    for _ in range(19):
        never.observe(K, 0)
        always.observe(K, K)
    start = never.prior.start
    assert never.alpha[0] < 0.05 and never.alpha[1:] == [start] * (K - 1)  # untested positions
    assert min(always.alpha) > 0.95
    assert always.expected_tokens(K) == pytest.approx(1 + sum(always.gains(K)))
    # Steps without drafts pull the estimates back to the prior (other requests fared better
    # meanwhile), and the request's own evidence ages with them: it is probed again.
    never.prior.alpha[0] = p0 = 0.5
    low, seen = never.alpha[0], never.seen[0]
    for _ in range(50):
        never.observe(0, 0)
    assert low < never.settle()[0] < p0
    # Folded in lazily (an idle request costs O(1) a step), as 50 single steps would.
    assert never.alpha[0] == pytest.approx(p0 + (low - p0) * 0.98**50)
    assert never.seen[0] == pytest.approx(seen * 0.98**50)


def test_positions_not_drafted_drift_back_towards_the_one_before():
    """Untested by choice (the chain was shorter), an estimate drifts up towards its
    predecessor's and its evidence ages; untested after a rejection, it stays."""
    t = AcceptanceTracker(K)
    t.alpha, t.seen = [0.8, 0.2, 0.1, 0.9], [10.0, 4.0, 4.0, 4.0]
    t.observe(1, 1)  # one draft, accepted: positions 1..3 not drafted
    assert t.alpha[1] == pytest.approx(0.2 + t.explore * (t.alpha[0] - 0.2))
    assert t.alpha[2] == pytest.approx(0.1 + t.explore * (t.alpha[1] - 0.1))
    assert t.alpha[3] == 0.9  # above the one before: left as it is
    assert t.seen[1] == pytest.approx(4.0 * (1 - t.explore))
    before = list(t.alpha)
    t.observe(K, 0)  # rejected at once: the later positions were drafted but not tested
    assert t.alpha[1:] == before[1:]
    # The prior: once per engine step, the positions no request drafted since the last step.
    lengths = AdaptiveLengths(K, costs())
    prior = lengths.prior
    prior.alpha = [0.8, 0.2, 0.2, 0.2]
    a, b = lengths.tracker(), lengths.tracker()
    a.observe(1, 1)
    b.observe(3, 3)
    measured = list(prior.alpha)
    lengths.choose([a, b], [K, K])
    assert prior.alpha[:3] == measured[:3]  # drafted by a request this step
    assert prior.alpha[3] == pytest.approx(0.2 + prior.explore * (measured[2] - 0.2))
    assert prior.deepest == 0


def test_a_bad_start_does_not_keep_the_rule_at_one_draft():
    """A request whose first four steps accept 1 draft of 4 (a hard stretch of text) and then
    accepts each draft with probability 0.77, at batch-1 costs (verify 1 + 0.05 n, a draft
    phase 0.07 + 0.18 per step): the rule used to stay at 1 draft a step for good (its estimate
    of position 2 measured on four rejections, never tested again); it returns to 3-4 drafts
    and to the fixed K's tokens per time."""
    rng = random.Random(0)
    c = StepCosts()
    for n in (1, 5, 2, 3, 5):
        c.observe_verify(n, 1.0 + 0.05 * n)
    for m in (4, 2, 1, 3):
        c.observe_draft(m, 0.07 + 0.18 * m)
    lengths = AdaptiveLengths(K, c)
    chosen, tokens, time = [], 0, 0.0
    tracker = lengths.tracker()
    for step in range(200):
        if step % 25 == 0:
            tracker = lengths.tracker()  # requests of about 64 tokens
        k = lengths.choose([tracker], [K])[0]
        if step < 4:
            k, accepted = K, 1
        else:
            accepted = 0
            while accepted < k and rng.random() < 0.77:
                accepted += 1
        tracker.observe(k, accepted)
        chosen.append(k)
        tokens += accepted + 1
        time += 1 + 0.05 * (k + 1) + (0.07 + 0.18 * k if k else 0.0)
    assert sum(chosen[50:]) / len(chosen[50:]) > 3.0
    static = (1 + sum(0.77**i for i in range(1, K + 1))) / (1 + 0.05 * (K + 1) + 0.07 + 0.18 * K)
    assert tokens / time > 0.95 * static


def test_rule_drafts_the_budget_until_costs_are_known():
    trackers = [AcceptanceTracker(K) for _ in range(3)]
    assert choose_lengths(trackers, [4, 2, 0], StepCosts()) == [4, 2, 0]


def test_rule_turns_off_useless_drafts_and_keeps_good_ones():
    never, always = AcceptanceTracker(K), AcceptanceTracker(K)
    for _ in range(12):
        never.observe(K, 0)
        always.observe(K, K)
    c = costs()
    assert choose_lengths([never] * 4, [K] * 4, c) == [0] * 4
    assert choose_lengths([always] * 4, [K] * 4, c) == [K] * 4
    # Mixed batch: the good requests draft, the useless ones do not.
    assert choose_lengths([always, never, always], [K, K, 2], c) == [K, 0, 2]
    # When verifying a token costs more than its chance of acceptance returns, fewer drafts.
    mid = AcceptanceTracker(K, alpha=[0.8] * K)
    assert choose_lengths([mid] * 8, [K] * 8, costs(per_token=0.01, draft_step=0.01)) == [K] * 8
    expensive = choose_lengths([mid] * 8, [K] * 8, costs(per_token=0.5, draft_step=0.01))
    assert max(expensive) < K


def simulate(p: float, policy: str, steps: int = 400, batch: int = 8, seed: int = 0):
    """A simulated engine: each draft accepted with probability p; a step takes
    1 + 0.02 * tokens + 0.15 * draft steps. Returns (tokens per unit time, chosen K per step)."""
    rng = random.Random(seed)
    trackers = [AcceptanceTracker(K) for _ in range(batch)]
    c = StepCosts()
    tokens = time = 0.0
    chosen = []
    for _ in range(steps):
        if policy == "adaptive":
            ks = choose_lengths(trackers, [K] * batch, c)
        else:
            ks = [K if policy == "static" else 0] * batch
        chosen.append(ks)
        step = 1 + 0.02 * (batch + sum(ks)) + 0.15 * max(ks)
        c.observe_verify(batch + sum(ks), step - 0.15 * max(ks))
        c.observe_draft(max(ks), 0.15 * max(ks))
        time += step
        for t, k in zip(trackers, ks, strict=True):
            a = 0
            while a < k and rng.random() < p:
                a += 1
            t.observe(k, a)
            tokens += a + 1
    return tokens / time, chosen


def test_explorations_draft_the_cheapest_request_s_whole_budget_at_a_fixed_interval():
    """While nothing drafts, every PROBE_EVERY steps (no back-off: a back-off to 16x the interval
    kept a wrong belief for thousands of steps) one request drafts its whole budget (one token
    times too few verify sizes to measure b again): the request whose catch-up costs least."""
    probes = Probes()
    budgets, catch_up = [4, 4, 0, 4], [120, 7, 0, 30]
    probed = [s for s in range(1, 200) if any(probes.apply([0] * 4, budgets, catch_up))]
    assert probed == [PROBE_EVERY * i for i in range(1, 7)] and probes.count == 6
    assert Probes(due=1).apply([0] * 4, budgets, catch_up) == [0, 4, 0, 0]
    assert Probes(due=1).apply([0, 0], [0, 3]) == [0, 3]  # no budget, no exploration
    assert probes.apply([0, 2, 0, 0], budgets, catch_up) == [0, 2, 0, 0]


def test_explorations_keep_their_cost_within_their_share_of_the_time():
    """An exploration that cost 0.02 s waits until the steps since (0.01 s each) have earned it
    back at 2% of their time: 100 steps; one that cost 0.1 s (a burst) waits no more than
    `max_wait` steps, not the 500 its cost would earn back."""
    for cost, wait in ((0.02, 100), (0.1, Probes().max_wait)):
        probes = Probes(due=1)
        assert any(probes.apply([0, 0], [4, 4], step_time=0.01)) and probes.probing
        probes.spent(cost)
        probes.due = 0  # the step interval has passed: only the time share holds the next one
        waited = 0
        while not any(probes.apply([0, 0], [4, 4], step_time=0.01)):
            waited += 1
        assert waited == pytest.approx(wait, abs=2)


@pytest.mark.parametrize("p", [0.0, 0.3, 0.6, 0.9])
def test_closed_loop_never_loses_to_plain_or_static(p):
    """Whatever the acceptance, the adaptive rule's throughput is within 5% of the better of
    plain decoding and static K (and above it where neither is right)."""
    adaptive, chosen = simulate(p, "adaptive")
    static, _ = simulate(p, "static")
    plain, _ = simulate(p, "plain")
    assert adaptive >= 0.95 * max(static, plain), (adaptive, static, plain)
    if p == 0.0:  # drafts stop within a few steps and stay rare (probes)
        assert all(max(ks) == 0 for ks in chosen[8:12])
        assert sum(max(ks) > 0 for ks in chosen[50:]) < 0.1 * len(chosen[50:])
    if p == 0.9:
        assert sum(sum(ks) for ks in chosen[50:]) / (8 * len(chosen[50:])) > 3.5


def test_guard_corrects_the_predicted_gain_by_the_measured_model_error():
    assert [batch_bucket(b) for b in (1, 9, 16, 17, 18, 32, 64)] == [1, 9, 16, 17, 17, 24, 32]
    guard = DraftGuard()
    assert guard.decide(16, True, 1.5)  # unmeasured: the rule is followed
    guard.observe(9, 0.03, 0.03, 9)  # the batch changed class: not counted
    assert guard.arms[16].seen == [0, 0]
    assert not guard.decide(16, False, 1.0) and guard.pending == (16, 0)  # measured as "off"
    # A fresh server's first burst: every step verifies K drafts for all 16 requests, so the
    # cost model, fitted to those steps alone, predicts them well and a plain step at about
    # their cost (gain 3.0 predicted). After min_seen drafting steps come min_seen plain ones,
    # whatever the gain: measured at a third of their prediction, they correct the gain to
    # 3.0 / 3.2 < 1, and the drafts are vetoed but for a re-measurement every `retest`.
    cold = DraftGuard()
    arms = []
    for _ in range(2 * cold.min_seen + 2 * cold.retest):
        arms.append(cold.decide(16, True, 3.0))
        cold.observe(16, 0.146 if arms[-1] else 0.045, 0.146, 23 if arms[-1] else 16)
    n = cold.min_seen
    assert arms[: 2 * n] == [True] * n + [False] * n
    retests = [i for i, a in enumerate(arms) if a][n:]  # drafting re-measured, every retest
    assert retests and all(
        j - i > cold.retest for i, j in zip([n - 1, *retests[:-1]], retests, strict=True)
    )
    assert cold.decide(15, True, 2.0)  # another class, unmeasured: trusted
    off = DraftGuard(enabled=False)  # the rule alone
    assert off.decide(16, True, 1.01) and not off.decide(16, False, 1.0) and off.pending is None


@pytest.mark.parametrize("gain", [1.1, 1.5])
def test_guard_keeps_drafts_the_model_predicts_well_whatever_one_request_accepts(gain):
    """Batch 1: a verify with drafts costs what the model predicts, and so does a plain step
    (timing noise of 5%), while the one request's accepted drafts come in streaks (all 4 for 2
    steps, then none for 8). At batch 1 the guard checks the cost model, not the tokens
    emitted, so such streaks cannot veto drafting (the per-emitted-token guard did: 7% against
    the fixed K): it drafts but for the plain steps that measure the model's error (min_seen at
    first; on a close call, one every `retest` + 1). From `goodput_batch` requests on, emitted
    tokens average over the batch and are compared too: where no draft is accepted, the same
    timings veto the drafts."""
    for batch in (1, DraftGuard.goodput_batch):
        rng = random.Random(0)
        guard = DraftGuard()
        arms = []
        for step in range(200):
            arms.append(guard.decide(batch, True, gain))
            predicted = 0.030 if arms[-1] else 0.029
            streak = 5 if step % 10 < 2 else 1  # at batch goodput_batch: nothing accepted
            emitted = (streak if batch == 1 else 1) if arms[-1] else 1
            seconds = predicted * rng.uniform(0.95, 1.05)
            guard.observe(batch, seconds, predicted, batch * emitted)
        share = sum(arms[2 * guard.min_seen :]) / len(arms[2 * guard.min_seen :])
        if batch == 1:
            assert share > (0.9 if gain < 1 + guard.margin else 0.99), share
        else:
            assert share < 0.5, share


@pytest.mark.parametrize("drafting_pays", [False, True])
def test_guard_follows_the_measured_arm_on_close_calls(drafting_pays):
    """The cost model predicts a small gain at batch 16 (as the fitted line did at saturation on
    the CPU pair), but a plain step measures 45 ms where the line says 51 and a step that drafts
    76 ms, above its prediction: within a few steps the guard stops the drafts, but for retests
    and probes. Where drafting measures faster (50 ms), it keeps them."""
    c = costs(base=0.033, per_token=0.0011, draft_step=0.006)
    mid = AcceptanceTracker(K, alpha=[0.6, 0.3, 0.1, 0.1])
    ks, gain = _best_lengths([mid] * 16, [K] * 16, c, [0.0] * 16)
    assert any(ks) and 1.0 < gain < 1.0 + DraftGuard.margin  # a close call
    lengths = AdaptiveLengths(K, c)
    drafted = []
    for _ in range(160):
        ks = lengths.choose([mid] * 16, [K] * 16, batch=16)
        on = any(ks)
        drafted.append(on)
        seconds = (0.050 if drafting_pays else 0.076) if on else 0.045
        predicted = c.step_time(16 + sum(ks), max(ks), sum(ks))
        lengths.observe_step(16, seconds, predicted, 23 if on else 16)
    share = sum(drafted[40:]) / len(drafted[40:])
    if drafting_pays:
        assert share > 0.9 and lengths.guard.vetoed < 0.1 * len(drafted)
    else:
        assert share < 0.12, share
        assert "vetoed by measurement" in lengths.summary()


PROMPT = [5, 17, 99, 3, 42, 7]


def test_engine_stops_drafting_for_a_useless_drafter(llama_target):
    """A random drafter on a random target (tau about 1): after a few cycles the engine decodes
    plainly (0 drafts per cycle) but for rare probes; the output equals plain decoding."""
    plain = SpeculativeEngine(llama_target).generate(PROMPT, 64).token_ids
    proposer = MoAProposer(make_drafter(llama_target, seed=5), llama_target)
    result = SpeculativeEngine(llama_target, proposer).generate(
        PROMPT, 64, num_speculative_tokens=K, adaptive=True
    )
    assert result.token_ids == plain
    hist = result.stats.draft_length_histogram
    assert result.stats.num_accepted_tokens <= 2  # the drafter really is useless
    assert hist[0] >= 0.8 * sum(hist), hist


# Measured costs replaced by a drafter 20x cheaper than a verify step (the test oracle runs the
# whole target per draft: measured, it would rightly be turned off).
CheapDrafts = fixed_costs(0.0005, verify_base=0.01)


def test_engine_keeps_k_for_a_drafter_that_always_matches(llama_target):
    plain = SpeculativeEngine(llama_target).generate(PROMPT, 64).token_ids
    proposer = OracleMoAProposer(make_drafter(llama_target), llama_target, corrupt_every=10**9)
    result = SpeculativeEngine(llama_target, proposer, step_costs=CheapDrafts()).generate(
        PROMPT, 64, num_speculative_tokens=K, adaptive=True
    )
    assert result.token_ids == plain
    hist = result.stats.draft_length_histogram
    assert hist[K] >= sum(hist) - 2, hist  # K every cycle but the last ones (no room)


def test_adaptive_by_default_fixed_k_when_turned_off(llama_target, monkeypatch):
    """The standalone engine adapts by default; adaptive=False or VLLM_MOA_ADAPTIVE=0 (which
    overrides adaptive=True) give the fixed K."""
    monkeypatch.setenv("VLLM_MOA_ADAPTIVE", "1")
    proposer = MoAProposer(make_drafter(llama_target, seed=5), llama_target)
    engine = SpeculativeEngine(llama_target, proposer)
    adaptive = engine.generate(PROMPT, 40, num_speculative_tokens=K)
    assert adaptive.stats.draft_length_histogram[0] > 20
    for kwargs, env in (({"adaptive": False}, "1"), ({"adaptive": True}, "0")):
        monkeypatch.setenv("VLLM_MOA_ADAPTIVE", env)
        hist = engine.generate(PROMPT, 40, num_speculative_tokens=K, **kwargs)
        hist = hist.stats.draft_length_histogram
        assert hist[K] >= sum(hist) - K, hist  # K but in the last cycles (no room)


class InStepEngine(SpeculativeEngine):
    """The reference: a cycle of 0 drafts goes through the proposer (propose 0, accept)."""

    def _plain_step(self, last, params, gen, stats, costs, behind):
        behind.flush()  # the prompt, if no cycle drafted yet
        token = self._speculate(last, self.target.seq_len, 0, params, gen, stats)[0]
        costs.observe_verify(1, 0.0)
        return token


def _proposer(kind, target):
    from vllm_moa.drafters.eagle.model import EagleDrafter
    from vllm_moa.drafters.independent.model import IndependentDrafter
    from vllm_moa.drafters.presets import TargetInfo, make_eagle_config, make_independent_config
    from vllm_moa.factories.proposers import make_proposer

    if kind.startswith("moa"):
        return OracleMoAProposer(make_drafter(target, tli=int(kind[-1]), seed=3), target)
    info = TargetInfo(target.shape, target.config.num_attention_heads)
    make = {"eagle": (EagleDrafter, make_eagle_config)}.get(
        kind, (IndependentDrafter, make_independent_config)
    )
    drafter = make[0](make[1](info, "small"))
    drafter.init_weights(3)
    return make_proposer(drafter.eval(), target)


def _catch_up_runs(target, kind, zero_rows=False):
    """Drafts (tokens, logits) of a deferred and an in-step engine, after checking each run's
    output equals plain decoding; `zero_rows`: the control, catch-up rows zeroed."""
    plain = SpeculativeEngine(target).generate(PROMPT, 40).token_ids
    runs = []
    for engine_class in (SpeculativeEngine, InStepEngine):
        proposer = _proposer(kind, target)
        drafts: list[tuple[list[int], torch.Tensor]] = []
        original, original_catch_up = proposer.propose, proposer.catch_up

        def propose(last, k, params, gen, original=original, drafts=drafts):
            proposal = original(last, k, params, gen)
            if k:
                drafts.append((proposal.tokens, proposal.logits))
            return proposal

        def catch_up(tokens, rows, original=original_catch_up):
            rows.layer_kv = rows.layer_kv * 0
            rows.hidden_states = {k: v * 0 for k, v in rows.hidden_states.items()}
            original(tokens, rows)

        proposer.propose = propose
        if zero_rows:
            proposer.catch_up = catch_up
        engine = engine_class(target, proposer, step_costs=AlternatingCosts())
        result = engine.generate(PROMPT, 40, num_speculative_tokens=K)
        assert result.token_ids == plain
        hist = result.stats.draft_length_histogram
        assert hist[0] >= 4 and hist[K] >= 4, hist  # both kinds of cycle, interleaved
        runs.append(drafts)
    return runs


@pytest.mark.parametrize("kind", ["moa_tli0", "moa_tli1", "eagle", "independent"])
def test_catch_up_drafts_what_a_proposer_kept_in_step_drafts(llama_target, kind, monkeypatch):
    """Plain cycles leave the proposer behind and `catch_up` hands their rows over at the next
    drafting cycle: every draft equals the one of a proposer run through each plain cycle, and
    the output equals plain decoding. Control: zeroed catch-up rows change the drafts."""
    monkeypatch.setenv("VLLM_MOA_ADAPTIVE", "1")
    caught_up, in_step = _catch_up_runs(llama_target, kind)
    assert [t for t, _ in caught_up] == [t for t, _ in in_step]
    # The same logits, up to float32 rounding: catch-up runs its rows through LSA together.
    for (_, a), (_, b) in zip(caught_up, in_step, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    if kind != "independent":  # it reads no target rows
        broken, in_step = _catch_up_runs(llama_target, kind, zero_rows=True)
        assert any(
            not torch.allclose(a, b, rtol=1e-4, atol=1e-4)
            for (_, a), (_, b) in zip(broken, in_step, strict=False)
        )


def test_a_seeded_sampled_request_repeats_as_plain_decoding(llama_target, monkeypatch):
    """Adaptive lengths follow measured times; a seeded request at temperature > 0 therefore gets
    no drafts, and its text is plain decoding's for that seed, every time."""
    from vllm_moa.decoding import SamplingParams

    monkeypatch.setenv("VLLM_MOA_ADAPTIVE", "1")
    params = SamplingParams(temperature=1.0)
    plain = SpeculativeEngine(llama_target).generate(PROMPT, 24, params, seed=7).token_ids
    engine = SpeculativeEngine(
        llama_target, OracleMoAProposer(make_drafter(llama_target, seed=5), llama_target)
    )
    for _ in range(2):
        result = engine.generate(PROMPT, 24, params, num_speculative_tokens=K, seed=7)
        assert result.token_ids == plain and result.stats.num_draft_tokens == 0
    assert engine.generate(PROMPT, 24, num_speculative_tokens=K, seed=7).stats.num_draft_tokens
