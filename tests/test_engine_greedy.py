"""Greedy speculative decoding emits exactly the tokens of plain greedy decoding."""

import pytest
import torch
from conftest import OracleMoAProposer, make_drafter, make_hf_model

from vllm_moa.decoding import SpeculativeEngine
from vllm_moa.drafters.moa.proposer import MoAProposer
from vllm_moa.hf_target import HFTarget

# The speculative machinery at a known K, drafting every cycle (test_adaptive.py: the rule).
pytestmark = pytest.mark.fixed_k

PROMPTS = [
    torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist()
    for n in (1, 4, 11, 23, 40)
]


@pytest.fixture(scope="module")
def plain_outputs(llama_target):
    engine = SpeculativeEngine(llama_target)
    return [engine.generate(p, 24).token_ids for p in PROMPTS]


@pytest.mark.parametrize("tli", [0, 1, 2])
@pytest.mark.parametrize("k", [1, 2, 4, 7])
def test_greedy_equality(llama_target, plain_outputs, tli, k):
    drafter = make_drafter(llama_target, tli=tli, seed=tli)
    accepted = 0
    for proposer in (MoAProposer(drafter, llama_target), OracleMoAProposer(drafter, llama_target)):
        engine = SpeculativeEngine(llama_target, proposer)
        for prompt, expected in zip(PROMPTS, plain_outputs, strict=True):
            result = engine.generate(prompt, 24, num_speculative_tokens=k)
            assert result.token_ids == expected
            assert result.finish_reason == "length"
            accepted += result.stats.num_accepted_tokens
    assert accepted > 0  # the oracle drafts do get accepted: both branches ran


@pytest.mark.parametrize("tli", [0, 2])
def test_eos_inside_accepted_drafts_stops_like_plain(llama_target, plain_outputs, tli):
    prompt, plain = PROMPTS[2], plain_outputs[2]
    eos = plain[9]
    cut = plain.index(eos) + 1
    drafter = make_drafter(llama_target, tli=tli)
    for proposer in (None, OracleMoAProposer(drafter, llama_target, corrupt_every=7)):
        result = SpeculativeEngine(llama_target, proposer).generate(
            prompt, 24, num_speculative_tokens=4, eos_token_ids=[eos]
        )
        assert result.token_ids == plain[:cut]
        assert result.finish_reason == "eos"


@pytest.mark.parametrize("k", [1, 3, 7])
def test_stops_at_the_model_max_length(k):
    target = HFTarget(make_hf_model(max_positions=40))
    prompt = list(range(1, 31))
    plain = SpeculativeEngine(target).generate(prompt, 50)
    assert len(prompt) + len(plain.token_ids) == 40 and plain.finish_reason == "context"
    spec = SpeculativeEngine(
        target, OracleMoAProposer(make_drafter(target, tli=1), target)
    ).generate(prompt, 50, num_speculative_tokens=k)
    assert spec.token_ids == plain.token_ids and spec.finish_reason == "context"


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "mistral"])
def test_greedy_equality_other_architectures(arch):
    target = HFTarget(make_hf_model(arch, seed=3))
    plain = SpeculativeEngine(target).generate(PROMPTS[3], 20).token_ids
    proposer = OracleMoAProposer(make_drafter(target, tli=1), target)
    result = SpeculativeEngine(target, proposer).generate(PROMPTS[3], 20, num_speculative_tokens=3)
    assert result.token_ids == plain
    assert result.stats.num_accepted_tokens > 0


def test_stats_are_consistent(llama_target):
    proposer = OracleMoAProposer(make_drafter(llama_target), llama_target, corrupt_every=3)
    s = (
        SpeculativeEngine(llama_target, proposer)
        .generate(PROMPTS[1], 30, num_speculative_tokens=4)
        .stats
    )
    assert s.num_generated_tokens == 30
    assert sum(s.accepted_length_histogram) == s.num_cycles == s.num_target_calls - 1
    assert s.mean_accepted_length == pytest.approx(1 + s.num_accepted_tokens / s.num_cycles)
    assert s.num_accepted_tokens == sum(s.accepted_per_position)
    assert s.num_draft_tokens == sum(s.drafted_per_position)
    rates = s.acceptance_rate_per_position
    assert all(0 <= r <= 1 for r in rates) and rates[0] > 0
    d = s.to_dict()
    assert d["target_calls"] == s.num_target_calls and d["tokens_per_second"] > 0


def test_bad_requests_are_clear_errors(llama_target):
    engine = SpeculativeEngine(llama_target, MoAProposer(make_drafter(llama_target), llama_target))
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.generate([], 5)
    with pytest.raises(ValueError, match=r"outside the vocabulary \[0, 256\)"):
        engine.generate([1, 999], 5)
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1, got 0"):
        engine.generate([1], 0)
    with pytest.raises(ValueError, match="num_speculative_tokens must be >= 1, got 0"):
        engine.generate([1], 5, num_speculative_tokens=0)
    with pytest.raises(ValueError, match="prompt has 256 tokens but the model's context is 256"):
        engine.generate([1] * 256, 5)


def test_drafter_for_another_target_is_refused(llama_target):
    other = HFTarget(make_hf_model(vocab_size=300))
    with pytest.raises(ValueError, match="vocab size 300, but the target has 256"):
        MoAProposer(make_drafter(other), llama_target)


@pytest.mark.parametrize("tli", [0, 1])
def test_greedy_equality_without_lsa(llama_target, plain_outputs, tli):
    """The "-LSA" ablation: CA memory = the target's final hidden states."""
    drafter = make_drafter(llama_target, tli=tli, memory="hidden")
    assert not hasattr(drafter, "layer_self_attention")
    proposer = OracleMoAProposer(drafter, llama_target)
    assert proposer.hidden_layers == (llama_target.shape.num_layers,)
    engine = SpeculativeEngine(llama_target, proposer)
    for prompt, expected in zip(PROMPTS, plain_outputs, strict=True):
        assert engine.generate(prompt, 24, num_speculative_tokens=4).token_ids == expected
