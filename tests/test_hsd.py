"""Hierarchical speculative decoding: each level's scoring equals its drafting, greedy output
equals plain decoding for every kind of stack, the target's law when sampling (with broken
verifiers as controls), per-level statistics, and mistakes in the levels."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import OracleMoAProposer, make_drafter, make_hf_model
from tests.test_sampling import NEW, PROMPT, VOCAB, _chi2_pvalue, _exact_joint, always_accept
from vllm_moa.decoding import NgramProposer, SamplingParams, SpeculativeEngine
from vllm_moa.decoding.proposer import LevelScorer
from vllm_moa.decoding.sampling import probabilities, verify_rejection
from vllm_moa.decoding.stats import GenerationStats, LevelStats
from vllm_moa.drafters.eagle.model import EagleDrafter
from vllm_moa.drafters.eagle.proposer import EagleProposer
from vllm_moa.drafters.independent.model import IndependentDrafter
from vllm_moa.drafters.independent.proposer import IndependentProposer
from vllm_moa.drafters.moa.proposer import MoAProposer
from vllm_moa.drafters.presets import TargetInfo, make_eagle_config, make_independent_config
from vllm_moa.hf_target import HFTarget
from vllm_moa.hsd.hierarchy import Block, HierarchicalEngine, Level

# The speculative machinery at a known K, drafting every cycle (test_adaptive.py: the rule).
pytestmark = pytest.mark.fixed_k

PROMPTS = [
    torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist()
    for n in (4, 11, 23)
] + [[5, 17, 9, 5, 17, 33, 5, 17]]  # the last one repeats itself: prompt lookup finds matches


class OracleScores:
    """A scorer whose rows get a large bonus on the target's greedy next token (except after
    every `corrupt_every`-th position), so that the level accepts some of the drafts below it
    and hands up mostly right ones: every branch of the engine runs."""

    corrupt_every = 4
    bonus = 50.0
    tokens: list[int]
    target: HFTarget

    def score(self, pending: list[int], tokens: list[int]) -> torch.Tensor:
        logits = super().score(pending, tokens).clone()  # type: ignore[misc]
        seq = [*self.tokens, *pending, *tokens]
        n = len(tokens) + 1
        best = self.target.model(torch.tensor([seq])).logits[0, -n:].argmax(-1)
        for j in range(n):
            if (len(seq) - n + j) % self.corrupt_every:
                logits[j, best[j]] += self.bonus
        return logits


class OracleMoA(OracleScores, MoAProposer):
    pass


class OracleEagle(OracleScores, EagleProposer):
    pass


class OracleIndependent(OracleScores, IndependentProposer):
    pass


def token_drafter(kind: str, target: HFTarget, seed: int = 0):
    info = TargetInfo(target.shape, target.config.num_attention_heads)
    if kind == "eagle":
        drafter = EagleDrafter(make_eagle_config(info, "small"))
    else:
        drafter = IndependentDrafter(make_independent_config(info, "small"))
    drafter.init_weights(seed)
    return drafter.eval()


def proposer(kind: str, target: HFTarget, seed: int = 0, oracle: bool = False):
    """A level of the given kind: `ngram`, `moa0`..`moa2` (TLI), `moa_hidden`, `eagle`,
    `independent`; `oracle`: with OracleScores (a drafter kind only)."""
    if kind == "ngram":
        return NgramProposer(target.shape.vocab_size)
    if kind.startswith("moa"):
        memory = "hidden" if kind == "moa_hidden" else "lsa"
        tli = 0 if kind == "moa_hidden" else int(kind[3:])
        drafter = make_drafter(target, tli=tli, seed=seed, memory=memory)
        return (OracleMoA if oracle else MoAProposer)(drafter, target)
    cls = {
        "eagle": (EagleProposer, OracleEagle),
        "independent": (IndependentProposer, OracleIndependent),
    }
    return cls[kind][oracle](token_drafter(kind, target, seed), target)


@pytest.fixture(scope="module")
def plain_outputs(llama_target):
    engine = SpeculativeEngine(llama_target)
    return [engine.generate(p, 20).token_ids for p in PROMPTS]


def _started(prop, target: HFTarget, prompt: list[int], verified: list[int]):
    """`prop` after the prompt and a catch-up on `verified`, the target cache at the same length
    (so the state has memory / features from two target passes)."""
    target.reset()
    prop.start(prompt, target.forward(torch.tensor(prompt), (target.shape.num_layers,)))
    prop.catch_up(verified, target.forward(torch.tensor(verified), (target.shape.num_layers,)))
    return prop


@pytest.mark.parametrize("kind", ["moa0", "moa1", "moa2", "moa_hidden", "eagle", "independent"])
def test_scoring_gives_the_distributions_drafting_gives(llama_target, kind):
    """A level's distribution at a position depends only on the tokens before it (and what the
    target verified): scoring in one call equals drafting teacher-forced, however the pending
    tokens are split, and no call changes the state."""
    target = llama_target
    prop = _started(proposer(kind, target, seed=3), target, PROMPTS[1], [7, 8, 9])
    assert isinstance(prop, LevelScorer)
    last, tokens = 42, [3, 200, 17, 5]
    forced = prop.propose(last, len(tokens) + 1, SamplingParams(), None, forced=[*tokens, 0])
    prop.withdraw()
    scored = prop.score([last], tokens)  # [n+1, V]
    torch.testing.assert_close(scored, forced.logits, rtol=1e-4, atol=1e-4)
    split = prop.score([last, *tokens[:2]], tokens[2:])
    torch.testing.assert_close(split, scored[2:], rtol=1e-4, atol=1e-4)
    drafted = prop.draft_after([last, *tokens[:2]], 3, SamplingParams(), None)
    assert (
        drafted.tokens == prop.score([last, *tokens[:2]], drafted.tokens)[:-1].argmax(-1).tolist()
    )
    torch.testing.assert_close(prop.score([last], tokens), scored)  # the state did not move
    # ... and the ordinary cycle still works after the hierarchy's calls.
    again = prop.propose(last, len(tokens) + 1, SamplingParams(), None, forced=[*tokens, 0])
    torch.testing.assert_close(again.logits, forced.logits)


STACKS = {
    "ngram": [("ngram", 3, False)],
    "moa": [("moa1", 3, False)],
    "eagle": [("eagle", 4, False)],
    "independent": [("independent", 2, False)],
    "ngram-moa": [("ngram", 3, False), ("moa1", 4, True)],
    "moa-moa": [("moa0", 3, False), ("moa2", 3, True)],
    "independent-eagle": [("independent", 2, False), ("eagle", 4, True)],
    "eagle-independent": [("eagle", 2, False), ("independent", 3, True)],
    "ngram-independent-moa": [
        ("ngram", 2, False),
        ("independent", 2, True),
        ("moa_hidden", 4, True),
    ],
}


@pytest.mark.parametrize("stack", list(STACKS))
def test_greedy_equality(llama_target, plain_outputs, stack):
    levels = [
        Level(kind, proposer(kind, llama_target, seed=i, oracle=oracle), t)
        for i, (kind, t, oracle) in enumerate(STACKS[stack])
    ]
    engine = HierarchicalEngine(llama_target, levels)
    accepted = [0] * len(levels)
    for prompt, expected in zip(PROMPTS, plain_outputs, strict=True):
        result = engine.generate(prompt, 20)
        assert result.token_ids == expected
        assert result.finish_reason == "length"
        accepted = [a + s.accepted for a, s in zip(accepted, result.stats.levels, strict=True)]
    if any(oracle for _, _, oracle in STACKS[stack]) or stack == "ngram":
        assert all(accepted), accepted  # drafts were accepted at every level: all branches ran


def test_greedy_equality_with_eos_and_the_context_limit():
    target = HFTarget(make_hf_model(max_positions=40))
    levels = [
        Level("o", OracleMoAProposer(make_drafter(target, tli=1), target, corrupt_every=7), 2),
        Level("m", proposer("moa0", target, oracle=True), 3),
    ]
    engine = HierarchicalEngine(target, levels)
    prompt = list(range(1, 31))
    plain = SpeculativeEngine(target).generate(prompt, 50)
    result = engine.generate(prompt, 50)
    assert result.token_ids == plain.token_ids and result.finish_reason == "context"
    eos = plain.token_ids[4]
    cut = plain.token_ids.index(eos) + 1
    result = engine.generate(prompt, 50, eos_token_ids=[eos])
    assert result.token_ids == plain.token_ids[:cut] and result.finish_reason == "eos"


def test_per_level_statistics_by_hand(llama_target, plain_outputs):
    """Perfect levels (T0 = 2 below T1 = 3): every round accepts both drafts and adds a bonus,
    so each cycle the target accepts 3 and adds 1. 13 tokens = the prefill's + 3 cycles of 4."""
    perfect = OracleMoAProposer(make_drafter(llama_target), llama_target, corrupt_every=10**9)
    scorer = proposer("moa1", llama_target, oracle=True)
    scorer.corrupt_every, scorer.bonus = 10**9, 1e4
    engine = HierarchicalEngine(llama_target, [Level("a", perfect, 2), Level("b", scorer, 3)])
    r = engine.generate(PROMPTS[0], 13)
    assert r.token_ids == SpeculativeEngine(llama_target).generate(PROMPTS[0], 13).token_ids
    s = r.stats
    assert s.num_target_calls == 4 and s.num_accepted_tokens == 9 and s.num_draft_tokens == 9
    bottom, middle = (level.to_dict() for level in s.levels)
    assert bottom == bottom | {"requests": 3, "forward_passes": 6, "proposed": 6, "accepted": 6}
    assert bottom["rejections"] == 0 and bottom["alpha"] == bottom["acceptance_rate"] == 1.0
    assert middle == middle | {"requests": 3, "forward_passes": 3, "proposed": 9, "accepted": 9}
    assert s.to_dict()["levels"] == [bottom, middle]


@pytest.mark.parametrize("stack", ["ngram-moa", "ngram-independent-moa"])
def test_per_level_statistics_are_consistent(llama_target, stack):
    levels = [
        Level(kind, proposer(kind, llama_target, seed=i, oracle=oracle), t)
        for i, (kind, t, oracle) in enumerate(STACKS[stack])
    ]
    s = HierarchicalEngine(llama_target, levels).generate(PROMPTS[3], 40).stats
    top = s.levels[-1]
    assert top.proposed == s.num_draft_tokens and top.accepted == s.num_accepted_tokens
    assert top.requests == s.num_cycles == s.num_target_calls - 1
    for below, above in zip(s.levels, s.levels[1:], strict=False):
        assert above.forward_passes == below.requests  # one round per block asked for
        assert above.proposed == below.accepted + above.forward_passes  # kept + own token
        assert below.accepted + below.rejections <= below.proposed
    assert s.levels[0].forward_passes == 0  # prompt lookup runs no model
    assert 0 < s.levels[0].alpha <= 1


def test_a_level_hands_up_its_own_law_and_the_rows_it_was_drawn_from(llama_target):
    """Algorithm 2 at one intermediate level, without the target: the first token of a block
    follows the level's own distribution (not the drafter's below), and every token goes up
    with the level's row at its prefix."""
    target = llama_target
    bottom = proposer("moa0", target, seed=1)
    middle = proposer("moa1", target, seed=2)
    engine = HierarchicalEngine(target, [Level("b", bottom, 2), Level("m", middle, 1)])
    params = SamplingParams(temperature=1.0, top_k=4)  # 4 cells: a sharp chi-square test
    prompt, last = PROMPTS[1], 9
    target.reset()
    out = target.forward(torch.tensor(prompt), engine.hidden_layers)
    for level in engine.levels:
        level.proposer.start(prompt, out)
    law = probabilities(middle.score([last], []), params)[0]
    stats = GenerationStats(3)
    stats.levels = [LevelStats("b", 2), LevelStats("m", 1)]
    counts = torch.zeros(law.shape[0])
    gen = torch.Generator().manual_seed(0)
    for i in range(800):
        block: Block = engine._gather(1, [last], 8, params, gen, stats)
        counts[block.tokens[0]] += 1
        assert block.probs is not None and len(block.tokens) == block.probs.shape[0] >= 1
        if i < 30:
            rows = probabilities(middle.score([last], block.tokens[:-1]), params)
            torch.testing.assert_close(block.probs, rows, rtol=1e-4, atol=1e-6)
    assert _chi2_pvalue(counts, law) > 1e-3
    below = probabilities(bottom.score([last], []), params)[0]
    assert _chi2_pvalue(counts, below) < 1e-6  # the level below's law is told apart


class BrokenBelowTheTarget(HierarchicalEngine):
    """The intermediate levels accept every draft (keeping the lower level's tokens but handing
    up their own rows); the target verifies correctly. Output follows neither model."""

    depth = 0

    def _gather(self, *args, **kwargs):
        self.depth += 1
        try:
            return super()._gather(*args, **kwargs)
        finally:
            self.depth -= 1

    def _verify(self, block, logits, probs, gen):
        if self.depth and probs is not None and block.tokens:
            return always_accept(block.tokens, block.probs, probs, gen)
        return super()._verify(block, logits, probs, gen)


@pytest.fixture(scope="module")
def small_vocab_target():
    model = make_hf_model(
        vocab_size=VOCAB, hidden_size=64, num_heads=1, num_layers=2, seed=6, logit_scale=8.0
    )
    return HFTarget(model)


@pytest.mark.slow
@pytest.mark.parametrize(
    "stack, engine_class, verifier, lossless",
    [
        ("ngram-moa", HierarchicalEngine, verify_rejection, True),
        ("ngram-moa", HierarchicalEngine, always_accept, False),  # the control must fail
        ("ngram-moa", BrokenBelowTheTarget, verify_rejection, False),  # so must this one
        ("independent-eagle", HierarchicalEngine, verify_rejection, True),
        ("independent-eagle", BrokenBelowTheTarget, verify_rejection, False),
    ],
)
def test_hierarchical_sampling_preserves_the_target_distribution(
    small_vocab_target, stack, engine_class, verifier, lossless
):
    """Tokens 2..4 (the ones the hierarchy produces) follow the target's joint law, exactly
    enumerated (as test_sampling does for one drafter), over 2000 seeded generations."""
    target = small_vocab_target
    params = SamplingParams(temperature=1.0)
    marginal = _exact_joint(target, params).sum(0).flatten()
    kinds = {
        "ngram-moa": [("ngram", 2), ("moa1", 2)],
        "independent-eagle": [("independent", 2), ("eagle", 2)],
    }
    levels = [Level(k, proposer(k, target, seed=i + 3), t) for i, (k, t) in enumerate(kinds[stack])]
    engine = engine_class(target, levels, rejection_verifier=verifier)
    counts = torch.zeros(VOCAB ** (NEW - 1))
    accepted = [0, 0]
    proposed = [0, 0]
    for seed in range(2000):
        r = engine.generate(PROMPT, NEW, params, seed=seed)
        a, b, c = r.token_ids[1:]
        counts[(a * VOCAB + b) * VOCAB + c] += 1
        accepted = [x + s.accepted for x, s in zip(accepted, r.stats.levels, strict=True)]
        proposed = [x + s.proposed for x, s in zip(proposed, r.stats.levels, strict=True)]
    if lossless and verifier is verify_rejection:  # acceptances and rejections at both levels
        assert all(0.1 < a / p < 0.95 for a, p in zip(accepted, proposed, strict=True))
    pvalue = _chi2_pvalue(counts, marginal)
    assert (pvalue > 1e-3) == lossless, pvalue


def test_bad_stacks_are_clear_errors(llama_target):
    moa = proposer("moa0", llama_target)
    with pytest.raises(ValueError, match="at least one drafter level"):
        HierarchicalEngine(llama_target, [])
    with pytest.raises(ValueError, match=r"level 1 \(ngram\) cannot verify .* only be the bottom"):
        HierarchicalEngine(
            llama_target, [Level("m", moa, 2), Level("ngram", NgramProposer(256), 2)]
        )
    with pytest.raises(ValueError, match="buffer size must be an int >= 1, got 0"):
        Level("m", moa, 0)
    engine = HierarchicalEngine(llama_target, [Level("m", moa, 2)])
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.generate([], 4)
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        engine.generate([1], 0)
