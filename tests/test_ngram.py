"""Prompt-lookup (n-gram) drafting: the lookup by hand, greedy equality with plain decoding,
the target's law when sampling (with a broken-verifier control), and the CLI."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import make_hf_model
from tests.test_sampling import (
    NEW,
    PROMPT,
    VOCAB,
    _chi2_pvalue,
    _exact_joint,
    always_accept,
)
from vllm_moa.decoding import NgramProposer, SamplingParams, SpeculativeEngine, verify_rejection
from vllm_moa.decoding.ngram_proposer import lookup
from vllm_moa.hf_target import HFTarget

# The speculative machinery at a known K, drafting every cycle (test_adaptive.py: the rule).
pytestmark = pytest.mark.fixed_k


@pytest.mark.parametrize(
    "tokens, k, expected",
    [
        ([1, 2, 3, 9, 1, 2, 3], 3, [9, 1, 2]),  # the trigram 1 2 3 occurred before: 9 followed
        ([5, 1, 2, 7, 6, 2], 2, [7, 6]),  # only the unigram 2 occurs earlier
        ([1, 2, 1, 2, 8, 1, 2], 1, [8]),  # the latest earlier occurrence wins
        ([4, 5, 6], 3, []),  # nothing repeats
        ([3, 3], 4, [3]),  # a match at the end gives what there is
    ],
)
def test_lookup_by_hand(tokens, k, expected):
    assert lookup(tokens, k) == expected


def test_drafts_continue_past_the_end_of_a_match():
    proposer = NgramProposer(vocab_size=10)
    proposer.start([1, 2, 1, 2], None)  # type: ignore[arg-type]
    drafts = proposer.propose(1, 5, SamplingParams(), None)
    assert drafts.tokens == [2, 1, 2, 1, 2]  # re-looked-up after each short match
    assert drafts.logits.argmax(-1).tolist() == drafts.tokens and drafts.probs is None
    proposer.withdraw()
    sampled = proposer.propose(1, 2, SamplingParams(temperature=1.0), None)
    assert sampled.probs is not None and sampled.probs.sum(-1).tolist() == [1.0, 1.0]


def test_ngram_greedy_output_equals_plain_decoding():
    target = HFTarget(make_hf_model(num_layers=2, seed=7, logit_scale=6.0))
    prompt = [5, 17, 9, 5, 17, 33, 5, 17]
    plain = SpeculativeEngine(target).generate(prompt, 60)
    engine = SpeculativeEngine(target, NgramProposer(target.shape.vocab_size))
    for adaptive in (False, True):
        r = engine.generate(prompt, 60, num_speculative_tokens=4, adaptive=adaptive)
        assert r.token_ids == plain.token_ids
    fixed = engine.generate(prompt, 60, num_speculative_tokens=4, adaptive=False)
    assert fixed.stats.num_accepted_tokens > 10  # a looping target: lookups land
    assert fixed.stats.num_target_calls < plain.stats.num_target_calls


@pytest.mark.slow
@pytest.mark.parametrize("verifier, lossless", [(verify_rejection, True), (always_accept, False)])
def test_ngram_sampling_preserves_the_target_distribution(verifier, lossless):
    """Point-mass drafts through the engine's rejection sampling: tokens 2..4 follow the
    target's joint law (as test_sampling checks for MoA); accepting every draft does not."""
    model = make_hf_model(
        vocab_size=VOCAB, hidden_size=64, num_heads=1, num_layers=2, seed=6, logit_scale=8.0
    )
    target = HFTarget(model)
    params = SamplingParams(temperature=1.0)
    marginal = _exact_joint(target, params).sum(0).flatten()
    engine = SpeculativeEngine(target, NgramProposer(VOCAB), rejection_verifier=verifier)
    counts = torch.zeros(VOCAB ** (NEW - 1))
    drafted = accepted = 0
    for seed in range(2000):
        r = engine.generate(
            PROMPT, NEW, params, num_speculative_tokens=3, seed=seed, adaptive=False
        )
        a, b, c = r.token_ids[1:]
        counts[(a * VOCAB + b) * VOCAB + c] += 1
        drafted += r.stats.num_draft_tokens
        accepted += r.stats.num_accepted_tokens
    if lossless:
        assert 0.1 < accepted / drafted < 0.95, (accepted, drafted)
    pvalue = _chi2_pvalue(counts, marginal)
    assert (pvalue > 1e-3) == lossless, pvalue


def test_generate_cli_with_ngram(tiny_target_dir, capsys):
    from vllm_moa.cli.main import main

    args = ["generate", "--target", tiny_target_dir, "--prompt", "def f(x):\n    return x"]
    args += ["--max-new-tokens", "24", "--json"]
    assert main(args) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main([*args, "--drafter", "ngram"]) == 0
    ngram = json.loads(capsys.readouterr().out)
    assert ngram["token_ids"] == plain["token_ids"] and ngram["speculative"]
