"""Adaptive speculation as the V2 speculator runs it (vllm_plugin/draft_steps.py): every request
verifies K slots whatever is drafted, so the rule picks the batch's number of draft steps m. A
simulated engine (a fake clock: a target step of 20 ms, a draft step of 2 ms) feeds it each
step's verdict as V2 reports it (rejected slots per request, the padding past m included): a
drafter that lands its drafts keeps K, a useless one ends at m = 0 with an exploration of K
steps now and then,
and each outcome is the other's control (same code, only the verdicts differ)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from benchmarks.rule_overhead import FakeClock
from vllm_moa.adaptive import AcceptanceTracker, StepCosts, best_draft_steps
from vllm_moa.vllm_plugin.draft_steps import DraftSteps

K = 4


def simulate(accept: float, steps: int = 300, batch: int = 2, seed: int = 0) -> list[int]:
    """Runs the rule over `steps` decode steps of `batch` requests; each real draft is accepted
    with probability `accept` (padding never); returns m per step."""
    rng = np.random.default_rng(seed)
    rule = DraftSteps(K, torch.device("cpu"))
    clock = rule.clock = FakeClock()
    req_ids = [f"r{i}" for i in range(batch)]
    chosen, m_prev = [], 0
    for _ in range(steps):
        verified = np.full(batch, K)
        rejected = []
        for _ in req_ids:
            accepted = 0
            while accepted < m_prev and rng.random() < accept:
                accepted += 1
            rejected.append(K - accepted)
        clock.now += 0.020  # the target's verify step
        rule.begin(req_ids, verified, batch * (1 + K), False, torch.tensor(rejected))
        m = rule.choose(K)
        clock.now += 0.002 * m  # the draft phase
        rule.end()
        chosen.append(m)
        m_prev = m
    return chosen


def test_a_drafter_that_lands_its_drafts_keeps_k():
    chosen = simulate(accept=0.9)
    assert np.mean(chosen[50:]) > 3.5, chosen[50:80]


def test_a_useless_drafter_stops_drafting_but_probes():
    chosen = simulate(accept=0.0)
    late = chosen[100:]
    # explorations (K steps at once) within their 2% share of the time; control: the landing
    # drafter above keeps K
    assert 0.002 * sum(late) <= 0.02 * 0.020 * len(late), late[:40]
    assert max(late) == K, "no exploration: a change of text would never be noticed"


@pytest.mark.parametrize("batch", [1, 8])
def test_padding_accepted_by_chance_is_not_counted_as_a_draft(batch):
    """The verdict counts accepted slots; past m they are padding: accepted padding must not
    make the rule believe in deeper drafts (clipped to m)."""
    rule = DraftSteps(K, torch.device("cpu"))
    rule.clock = FakeClock()
    req_ids = [f"r{i}" for i in range(batch)]
    none_rejected = torch.zeros(batch, dtype=torch.int64)
    for _ in range(3):
        rule.begin(req_ids, np.full(batch, K), batch * 5, False, none_rejected)
        rule.choose(1)  # one draft step, all K slots accepted (3 of them padding)
        rule.end()
    tracker = rule.trackers["r0"]
    assert tracker.seen[1] == 0.0 and tracker.seen[0] > 0


def test_best_draft_steps_weighs_acceptance_against_draft_cost():
    costs = StepCosts()
    costs.draft_step = 0.002  # 2 ms a step against a 20 ms verify
    good = [AcceptanceTracker(K, alpha=[0.9] * K) for _ in range(4)]
    bad = [AcceptanceTracker(K, alpha=[0.01] * K) for _ in range(4)]
    assert best_draft_steps(good, K, 0.020, costs)[0] == K
    assert best_draft_steps(bad, K, 0.020, costs)[0] == 0
    costs.draft_step = 0.015  # a draft step almost a verify: only the first pays, barely
    assert best_draft_steps(good, K, 0.020, costs)[0] < K


def test_verdict_buffers_are_reused_and_never_overwritten_while_pending():
    """Each step's verdict goes to one of PENDING_MAX host buffers in turn (no allocation a
    step), grown when the batch grows; a buffer comes round again only after its step is folded
    in, so every verdict learnt is the one copied (control: each step's verdict differs)."""
    from vllm_moa.vllm_plugin.draft_steps import PENDING_MAX

    rule = DraftSteps(K, torch.device("cpu"))
    rule.clock = FakeClock()
    learnt: list[list[int]] = []
    learn = rule._learn
    rule._learn = lambda step: (learnt.append(step.rejected.tolist()), learn(step))  # type: ignore[method-assign]
    storages = set()
    sent = []
    for t in range(12):
        batch = 2 if t < 6 else 70  # the batch outgrows the first buffers (64)
        verdict = [(t + i) % (K + 1) for i in range(batch)]
        sent.append(verdict)
        rule.begin([f"r{i}" for i in range(batch)], None, batch, False, torch.tensor(verdict))
        storages.add(rule.current.rejected.untyped_storage().data_ptr())
        assert len(rule.pending) <= PENDING_MAX
        rule.choose(K)
        rule.end()
    assert len(storages) == 2 * PENDING_MAX  # one ring per batch size class, reused
    assert learnt == sent[: len(learnt)] and len(learnt) >= 10
