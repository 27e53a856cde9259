"""Adaptive speculation cannot lock itself out: fault injection into the rule's timings.

A simulated single-request engine (the standalone engine's and the client's loop through
`OneRequest`; the serving engines feed the same `AdaptiveLengths`) whose steps are timed from a
cost model: a verify step of 10 ms + 1 ms a token, a draft phase of 0.5 ms + 2 ms a step, each
draft accepted with probability 0.8, so drafting K = 4 pays about 2.3x. Bursts make steps 5x
slower: during warm-up only the steps with drafts (first calls at new shapes, what a fresh
server's start-up does), mid-run every step (another process), or only the drafting ones again.
After each burst the rule must draft at its normal rate again within a bounded number of steps
(`RECOVERY`), measured by the tokens it drafts. The control: the same run without exploration
stays locked out, which is what a new user's quick start met (b believed at 36 ms a token)."""

from __future__ import annotations

import random

import pytest

from vllm_moa.adaptive import AdaptiveLengths, OneRequest

K = 4
STEPS = 1400
RECOVERY = 400  # steps after a burst's end by which drafting is back to normal
WARM_UP = (0, 60)
MID_RUN = (700, 760)


def run(bursts: list[tuple[int, int, bool]], explore: bool = True, seed: int = 0) -> list[int]:
    """Drafts per step over STEPS steps; `bursts`: (first, end, only steps with drafts)."""
    rng = random.Random(seed)
    lengths = AdaptiveLengths(K)
    if not explore:
        lengths.probes.due = lengths.probes.every = 10**9
    one = OneRequest.of(lengths)
    costs = lengths.costs
    drafted = []
    for step in range(STEPS):
        k = one.choose(K, remaining=10**6)
        slow = any(lo <= step < hi and (k or not drafts_only) for lo, hi, drafts_only in bursts)
        factor = 5.0 if slow else 1.0
        verify = factor * (0.010 + 0.001 * (k + 1))
        phase = factor * (0.0005 + 0.002 * k) if k else 0.0
        accepted = 0
        while accepted < k and rng.random() < 0.8:
            accepted += 1
        costs.observe_verify(k + 1, verify)
        if k:
            costs.observe_draft(k, phase, rows=accepted + 1)
        plain = costs.step_time(1, 0)
        one.observe(k, accepted, verify + phase, probe_cost=verify + phase - plain if k else None)
        drafted.append(k)
    return drafted


def mean(drafted: list[int], lo: int, hi: int) -> float:
    return sum(drafted[lo:hi]) / (hi - lo)


def test_without_faults_the_rule_drafts_its_budget():
    assert mean(run([]), 100, STEPS) > 2.5


@pytest.mark.parametrize(
    "bursts",
    [
        [(*WARM_UP, True)],
        [(*MID_RUN, False)],
        [(*MID_RUN, True)],
        [(*WARM_UP, True), (*MID_RUN, True)],
    ],
    ids=["warm-up", "mid-run", "mid-run-drafts-only", "both"],
)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_after_a_burst_of_slow_steps_the_rule_drafts_again(bursts, seed):
    normal = run([], seed=seed)
    faulty = run(bursts, seed=seed)
    for _, end, _ in bursts:
        window = (end + RECOVERY, min(end + RECOVERY + 200, STEPS))
        assert mean(faulty, *window) >= 0.75 * mean(normal, *window), (end, window)


def test_control_without_exploration_a_warm_up_burst_locks_drafting_out():
    """The burst's belief (drafting steps cost 5x) stops drafting, and nothing measures them
    again: the test above would catch a rule that cannot recover."""
    locked = run([(*WARM_UP, True)], explore=False)
    assert mean(locked, WARM_UP[1] + RECOVERY, STEPS) < 0.5
