"""The hierarchy planner: its latency model by hand and against the engine's own buffering, the
exact search's choices, and its input files."""

from __future__ import annotations

import json
import math

import pytest
import torch

from vllm_moa.decoding import SamplingParams
from vllm_moa.decoding.proposer import DraftProposal
from vllm_moa.decoding.stats import GenerationStats, LevelStats
from vllm_moa.hsd.hierarchy import HierarchicalEngine, Level
from vllm_moa.hsd.plan import (
    Candidate,
    PassCost,
    PlanInputs,
    best_plans,
    bottom_stage,
    evaluate,
    search,
    upper_stage,
)


def sd_latency(alpha: float, t: int, draft: float, verify: float) -> float:
    """Standard speculative decoding: (T c_draft + c_target) / E[tokens per cycle]."""
    return (t * draft + verify) / ((1 - alpha ** (t + 1)) / (1 - alpha))


def two_candidates(alpha_moa: float = 0.8) -> PlanInputs:
    """Prompt lookup (free, often wrong for the target, better for MoA) below MoA (a draft step
    0.15, a scoring pass 0.2) below a target of 1.0 per pass."""
    return PlanInputs(
        (Candidate("ngram", 0.0, None), Candidate("moa", 0.15, PassCost(0.2))),
        PassCost(1.0),
        {"ngram": {"moa": 0.6, "target": 0.3}, "moa": {"target": alpha_moa}},
    )


@pytest.mark.parametrize("alpha, t", [(0.7, 4), (0.3, 1), (0.95, 8), (0.0, 3), (1.0, 2)])
def test_one_drafter_is_standard_speculative_decoding(alpha, t):
    inputs = PlanInputs(
        (Candidate("d", 0.1, PassCost(0.2)),), PassCost(1.0, 0.05), {"d": {"target": alpha}}
    )
    plan = evaluate(inputs, ["d"], [t])
    tokens = t + 1.0 if alpha == 1 else (1 - alpha ** (t + 1)) / (1 - alpha)
    assert plan.tokens_per_target_call == pytest.approx(tokens)
    verify = 1.0 + 0.05 * (t + 1)  # the target's pass over the last token and T drafts
    assert plan.latency_s == pytest.approx((t * 0.1 + verify) / tokens)
    if alpha < 1:
        assert plan.latency_s == pytest.approx(sd_latency(alpha, t, 0.1, verify))
    assert plan.passes_per_token == pytest.approx((t / tokens, 1 / tokens))


def test_taking_in_verified_tokens_costs_per_target_pass():
    """Each level's `commit` (MoA: the memory rows of the verified tokens) runs once per target
    pass over the tokens it emitted."""
    commit = PassCost(0.01, 0.002)
    inputs = PlanInputs(
        (Candidate("d", 0.1, PassCost(0.2), commit=commit),),
        PassCost(1.0),
        {"d": {"target": 0.6}},
    )
    plan = evaluate(inputs, ["d"], [3])
    tokens = (1 - 0.6**4) / 0.4
    assert plan.latency_s == pytest.approx((0.3 + 1.0 + 0.01 + 0.002 * tokens) / tokens)


def test_two_levels_by_hand():
    """T0 = T1 = 1: one round per request; MoA hands up 1 token (it rejects the lookup's) or 2
    (it accepts it and adds its own)."""
    inputs = two_candidates()
    plan = evaluate(inputs, ["ngram", "moa"], [1, 1])
    a01, a = 0.6, 0.8
    tokens = (1 - a01) * (1 + a) + a01 * (1 + a + a * a)
    cost = 0.0 + 0.2 + 1.0  # a free lookup, one scoring pass, one target pass
    assert plan.tokens_per_target_call == pytest.approx(tokens)
    assert plan.latency_s == pytest.approx(cost / tokens)
    assert plan.passes_per_token == pytest.approx((1 / tokens, 1 / tokens, 1 / tokens))


def test_rounds_at_the_extremes_of_acceptance():
    """alpha = 0: every round adds one token, gamma = T; alpha = 1: every round adds T0 + 1."""
    below = bottom_stage(Candidate("d", 0.1, None), 3)
    stage = upper_stage(below, PassCost(0.5), 0.0, 5)
    assert stage.passes[-1] == pytest.approx(5) and stage.sizes[5] == pytest.approx(1)
    assert stage.cost_s == pytest.approx(5 * (0.3 + 0.5))
    stage = upper_stage(below, PassCost(0.5), 1.0, 5)
    assert stage.passes[-1] == pytest.approx(2) and stage.sizes[8] == pytest.approx(1)
    assert sum(stage.sizes) == pytest.approx(1)


class _Fixed:
    """A fake level over a 2-token vocabulary: it drafts token 0 as a point mass and, scoring,
    gives token 0 probability `alpha` everywhere, so its verdicts on token 0 are IID coins."""

    hidden_layers: tuple[int, ...] = ()

    def __init__(self, alpha: float = 0.5) -> None:
        self.alpha = alpha

    def start(self, prompt_ids, prefill) -> None: ...
    def catch_up(self, tokens, verified) -> None: ...
    def propose(self, *args, **kwargs): ...
    def accept(self, accepted, verified) -> None: ...
    def withdraw(self) -> None: ...

    def draft_after(self, pending, num_tokens, params, generator) -> DraftProposal:
        points = torch.zeros(num_tokens, 2)
        points[:, 0] = 1.0
        return DraftProposal([0] * num_tokens, points.log(), points)

    def score(self, pending, tokens) -> torch.Tensor:
        law = torch.tensor([self.alpha, 1 - self.alpha])
        return law.log().expand(len(tokens) + 1, 2)


def test_the_model_describes_the_engines_buffering(llama_target):
    """The DP's gamma (rounds per request) and the law of the sizes handed up match what the
    engine's own recursion does, measured on 3000 requests of a 3-level stack with IID
    acceptance (fake levels, no target pass). Level 1 accepts the point masses on token 0 with
    its p(0) = 0.6; level 2 (p(0) = 0.4) accepts level 1's tokens, drawn from (0.6, 0.4), with
    probability 1 - TV = min(0.6, 0.4) + min(0.4, 0.6) = 0.8, independently."""
    alphas, buffers = (0.6, 0.8), (2, 3, 4)
    levels = [
        Level(f"l{i}", _Fixed(a), t)
        for i, (a, t) in enumerate(zip((1.0, 0.6, 0.4), buffers, strict=True))
    ]
    engine = HierarchicalEngine(llama_target, levels)
    stats = GenerationStats(sum(buffers))
    stats.levels = [LevelStats(level.name, level.buffer) for level in levels]
    gen = torch.Generator().manual_seed(0)
    sizes = torch.zeros(32)
    requests = 3000
    for _ in range(requests):
        block = engine._gather(2, [0], 1000, SamplingParams(temperature=1.0), gen, stats)
        sizes[len(block.tokens)] += 1
    stage = bottom_stage(Candidate("l0", 0.0, None), buffers[0])
    stage = upper_stage(stage, PassCost(0.0), alphas[0], buffers[1])
    middle_rounds = stage.passes[-1]
    stage = upper_stage(stage, PassCost(0.0), alphas[1], buffers[2])
    top, middle = stats.levels[2], stats.levels[1]
    assert top.forward_passes / requests == pytest.approx(stage.passes[-1], rel=0.03)
    assert middle.forward_passes / middle.requests == pytest.approx(middle_rounds, rel=0.03)
    expected = torch.tensor(stage.sizes + (0.0,) * (32 - len(stage.sizes)))
    assert (sizes / requests - expected).abs().max() < 0.03, (sizes / requests, expected)


def test_a_three_level_stack_beats_the_best_single_drafter():
    plans = best_plans(two_candidates(), max_buffer=8)
    best = plans[0]
    assert best.levels == ("ngram", "moa")
    single = min((p for p in plans if len(p.levels) == 1), key=lambda p: p.latency_s)
    assert single.levels == ("moa",)
    assert best.latency_s < 0.85 * single.latency_s
    assert plans[-1].levels == ()  # plain decoding is slowest here
    # Every search result is the model's value for that stack.
    assert evaluate(two_candidates(), best.levels, best.buffers) == best


def test_the_search_keeps_order_measured_pairs_and_scorers():
    inputs = PlanInputs(
        (
            Candidate("ngram", 0.0, None, draft_rate=0.5),
            Candidate("a", 0.1, PassCost(0.2)),
            Candidate("b", 0.2, PassCost(0.3)),
        ),
        PassCost(1.0),
        {"ngram": {"a": 0.5, "target": 0.4}, "a": {"target": 0.7}, "b": {"target": 0.8}},
    )
    stacks = {p.levels for p in search(inputs, max_buffer=2)}
    # No ngram -> b or a -> b (not measured); ngram never above another level.
    assert stacks == {(), ("ngram",), ("a",), ("b",), ("ngram", "a")}
    assert sum(1 for _ in search(inputs, max_buffer=3)) == 1 + 3 + 3 + 3 + 9


def test_slow_drafters_lose_to_plain_decoding():
    inputs = PlanInputs(
        (Candidate("d", 2.0, PassCost(2.0)),), PassCost(1.0), {"d": {"target": 0.5}}
    )
    assert best_plans(inputs)[0].levels == ()


def test_inputs_round_trip_and_bad_inputs(tmp_path):
    inputs = two_candidates()
    path = tmp_path / "inputs.json"
    inputs.save(path)
    assert PlanInputs.load(path) == inputs
    assert json.loads(path.read_text())["candidates"][0]["score"] is None
    with pytest.raises(ValueError, match=r"must be in \[0, 1\], got 1\.5"):
        PlanInputs((), PassCost(1.0), {"x": {"target": 1.5}})
    with pytest.raises(ValueError, match="distinct and not 'target'"):
        PlanInputs((Candidate("target", 0.1, None),), PassCost(1.0), {})
    with pytest.raises(ValueError, match="base_s must be a finite number >= 0"):
        PassCost(-1.0)
    with pytest.raises(ValueError, match="not a planner input"):
        PlanInputs.from_dict({"candidates": []})
    with pytest.raises(FileNotFoundError, match="does not exist"):
        PlanInputs.load(tmp_path / "none.json")
    lacking = PlanInputs(inputs.candidates, PassCost(1.0), {"moa": {"target": 0.5}})
    with pytest.raises(ValueError, match="no acceptance measured for ngram -> moa"):
        evaluate(lacking, ["ngram", "moa"], [2, 2])
    with pytest.raises(ValueError, match="no acceptance measured for ngram -> target"):
        evaluate(lacking, ["ngram"], [2])
    with pytest.raises(ValueError, match="ngram cannot verify"):
        evaluate(
            PlanInputs(inputs.candidates, PassCost(1.0), {"moa": {"ngram": 0.5, "target": 0.5}}),
            ["moa", "ngram"],
            [2, 2],
        )
    with pytest.raises(ValueError, match="'x' is not a measured candidate"):
        evaluate(inputs, ["x"], [1])
    assert math.isfinite(evaluate(inputs, ["ngram"], [4]).latency_s)
