"""Adaptive speculation length (decoding/adaptive.py): the estimates, the goodput rule on
synthetic costs, and the standalone engine's decisions with drafters that never / always match
(outputs identical to plain decoding in both)."""

from __future__ import annotations

import random

import pytest
from conftest import OracleMoAProposer, make_drafter

from vllm_moa.decoding import MoAProposer, SpeculativeEngine
from vllm_moa.decoding.adaptive import AcceptanceTracker, StepCosts, choose_lengths

K = 4


@pytest.fixture(autouse=True)
def adaptive_allowed(monkeypatch):
    """tests/conftest.py sets VLLM_MOA_ADAPTIVE=0 (fixed K) for the other tests."""
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


def test_tracker_learns_per_position_acceptance():
    never, always = AcceptanceTracker(K), AcceptanceTracker(K)
    for _ in range(12):
        never.observe(K, 0)
        always.observe(K, K)
    start = never.prior.start
    assert never.alpha[0] < 0.05 and never.alpha[1:] == [start] * (K - 1)  # untested positions
    assert min(always.alpha) > 0.95
    assert always.expected_tokens(K) == pytest.approx(1 + sum(always.gains(K)))
    # Steps without drafts pull the estimates back to the prior: the request is probed again.
    low = never.alpha[0]
    for _ in range(50):
        never.observe(0, 0)
    assert low < never.alpha[0] < start


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


class CheapDrafts(StepCosts):
    """Measured costs replaced by a drafter 20x cheaper than a verify step (the test oracle
    runs the whole target per draft: measured, it would rightly be turned off)."""

    def observe_draft(self, steps: int, seconds: float) -> None:
        super().observe_draft(1, 0.0005)

    def observe_verify(self, tokens: int, seconds: float) -> None:
        super().observe_verify(tokens, 0.01 + 0.0001 * tokens)


def test_engine_keeps_k_for_a_drafter_that_always_matches(llama_target):
    plain = SpeculativeEngine(llama_target).generate(PROMPT, 64).token_ids
    proposer = OracleMoAProposer(make_drafter(llama_target), llama_target, corrupt_every=10**9)
    result = SpeculativeEngine(llama_target, proposer, step_costs=CheapDrafts()).generate(
        PROMPT, 64, num_speculative_tokens=K, adaptive=True
    )
    assert result.token_ids == plain
    hist = result.stats.draft_length_histogram
    assert hist[K] >= sum(hist) - 2, hist  # K every cycle but the last ones (no room)


def test_fixed_k_by_default_and_when_turned_off(llama_target, monkeypatch):
    """The standalone engine adapts only when asked (adaptive=True), and VLLM_MOA_ADAPTIVE=0
    overrides even that."""
    monkeypatch.setenv("VLLM_MOA_ADAPTIVE", "1")
    proposer = MoAProposer(make_drafter(llama_target, seed=5), llama_target)
    engine = SpeculativeEngine(llama_target, proposer)
    adaptive = engine.generate(PROMPT, 40, num_speculative_tokens=K, adaptive=True)
    assert adaptive.stats.draft_length_histogram[0] > 20
    for kwargs, env in (({}, "1"), ({"adaptive": True}, "0")):
        monkeypatch.setenv("VLLM_MOA_ADAPTIVE", env)
        hist = engine.generate(PROMPT, 40, num_speculative_tokens=K, **kwargs)
        hist = hist.stats.draft_length_histogram
        assert hist[K] >= sum(hist) - K, hist  # K but in the last cycles (no room)
