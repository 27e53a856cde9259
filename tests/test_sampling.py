"""Sampling: processed distributions, and lossless rejection sampling (with failing controls)."""

import itertools

import pytest
import torch
from conftest import AlternatingCosts, make_drafter, make_hf_model
from scipy.stats import chi2

from vllm_moa.decoding import SamplingParams, SpeculativeEngine, Verdict
from vllm_moa.decoding.sampling import probabilities, verify_rejection
from vllm_moa.drafters.moa.proposer import MoAProposer
from vllm_moa.hf_target import HFTarget


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temperature": -1.0}, "temperature must be >= 0"),
        ({"temperature": float("nan")}, "temperature must be a finite number"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"top_k": -2}, "top_k must be an int >= 0"),
    ],
)
def test_sampling_params_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_top_k_and_top_p_by_hand():
    logits = torch.log(torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]))
    p = probabilities(logits, SamplingParams(temperature=1.0, top_k=2))
    torch.testing.assert_close(p, torch.tensor([5 / 7, 2 / 7, 0, 0, 0]))
    # top-p 0.7: 0.5 alone < 0.7, 0.5 + 0.2 reaches it -> keep the first two.
    p = probabilities(logits, SamplingParams(temperature=1.0, top_p=0.7))
    torch.testing.assert_close(p, torch.tensor([5 / 7, 2 / 7, 0, 0, 0]))
    p = probabilities(logits, SamplingParams(temperature=1.0, top_p=0.71))
    torch.testing.assert_close(p, torch.tensor([50, 20, 15, 0, 0]) / 85.0)
    # temperature 0.5 squares then renormalises.
    p = probabilities(logits, SamplingParams(temperature=0.5))
    sq = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]) ** 2
    torch.testing.assert_close(p, sq / sq.sum())


def always_accept(draft, draft_probs, target_probs, generator):
    """A broken verifier: accepts every draft (outputs follow the drafter, not the target)."""
    return Verdict(
        len(draft), int(torch.multinomial(target_probs[len(draft)], 1, generator=generator))
    )


def resample_from_target(draft, draft_probs, target_probs, generator):
    """A subtly broken verifier: on rejection it samples from p instead of max(0, p - q)."""
    k = len(draft)
    for i, tok in enumerate(draft):
        u = torch.rand((), generator=generator)
        if u * draft_probs[i, tok] >= target_probs[i, tok]:
            return Verdict(i, int(torch.multinomial(target_probs[i], 1, generator=generator)))
    return Verdict(k, int(torch.multinomial(target_probs[k], 1, generator=generator)))


def _chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square p-value, pooling cells expected < 5 into one."""
    n = counts.sum()
    expected = probs * n
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = exp > 0
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum().item()
    return float(chi2.sf(stat, int(keep.sum()) - 1))


@pytest.mark.parametrize(
    "verifier, lossless",
    [(verify_rejection, True), (always_accept, False), (resample_from_target, False)],
)
def test_single_step_rejection_sampling_distribution(verifier, lossless):
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.25, 0.25, 0.25, 0.25]])
    q = torch.tensor([[0.1, 0.2, 0.3, 0.4]])
    counts = torch.zeros(4)
    for _ in range(8000):
        draft = [int(torch.multinomial(q[0], 1, generator=g))]
        v = verifier(draft, q, p, g)
        counts[draft[0] if v.num_accepted else v.next_token] += 1
    pvalue = _chi2_pvalue(counts, p[0])
    # Deterministic seeds: the lossless verifier passes at 1e-3, the broken ones fail by far.
    assert (pvalue > 1e-3) == lossless, pvalue


VOCAB = 4
PROMPT = [1, 3, 0, 2, 2]
NEW = 4  # token 1 from the prefill, tokens 2..4 from speculative cycles (first cycle K=2)


@pytest.fixture(scope="module")
def small_vocab_target():
    # A larger LM head makes the target's distributions clearly non-uniform.
    model = make_hf_model(
        vocab_size=VOCAB, hidden_size=64, num_heads=1, num_layers=2, seed=6, logit_scale=8.0
    )
    return HFTarget(model)


def _exact_joint(target: HFTarget, params: SamplingParams) -> torch.Tensor:
    """P(tokens 1..NEW) under plain sampling from the target: [VOCAB] * NEW, by enumeration."""
    prefixes = torch.tensor(list(itertools.product(range(VOCAB), repeat=NEW - 1)))
    ids = torch.cat([torch.tensor(PROMPT).expand(len(prefixes), -1), prefixes], dim=1)
    with torch.no_grad():
        logits = target.model(ids).logits[:, len(PROMPT) - 1 :]  # [N, NEW, V]
    probs = probabilities(logits, params)  # row j: law of token j+1 given tokens 1..j
    steps = torch.arange(NEW - 1)
    prefix_prob = probs[:, steps, :].gather(2, prefixes[:, :, None])[..., 0].prod(1)  # [N]
    joint = prefix_prob[:, None] * probs[:, NEW - 1, :]  # [N, V], rows in product order
    return joint.reshape([VOCAB] * NEW)


@pytest.mark.slow
@pytest.mark.parametrize(
    "params, verifier, lossless, adaptive",
    [
        (SamplingParams(temperature=1.0), verify_rejection, True, False),
        (SamplingParams(temperature=0.8, top_p=0.8, top_k=3), verify_rejection, True, False),
        (SamplingParams(temperature=0.8, top_p=0.8, top_k=3), verify_rejection, True, True),
        (SamplingParams(temperature=1.0), always_accept, False, False),  # the control must fail
    ],
)
def test_speculative_sampling_preserves_the_target_distribution(
    small_vocab_target, params, verifier, lossless, adaptive, monkeypatch
):
    monkeypatch.setenv("VLLM_MOA_ADAPTIVE", "1" if adaptive else "0")
    target = small_vocab_target
    exact = _exact_joint(target, params)
    # Tokens 2..NEW are the ones speculation produces; test their joint law (64 cells).
    marginal = exact.sum(0).flatten()
    proposer = MoAProposer(make_drafter(target, tli=1, seed=1), target)
    costs = AlternatingCosts(verify_sizes=(1, 4)) if adaptive else None
    engine = SpeculativeEngine(target, proposer, rejection_verifier=verifier, step_costs=costs)
    engine.repeatable_seeds = False  # the costs are injected: the seeded lengths repeat anyway
    counts = torch.zeros(VOCAB ** (NEW - 1))
    drafted = accepted = 0
    lengths = [0] * 4
    for seed in range(2000):
        r = engine.generate(
            PROMPT, NEW, params, num_speculative_tokens=3, seed=seed, adaptive=adaptive
        )
        a, b, c = r.token_ids[1:]
        counts[(a * VOCAB + b) * VOCAB + c] += 1
        drafted += r.stats.num_draft_tokens
        accepted += r.stats.num_accepted_tokens
        lengths = [x + y for x, y in zip(lengths, r.stats.draft_length_histogram, strict=True)]
    if lossless:
        assert 0.1 < accepted / drafted < 0.95  # both acceptances and rejections happened
    if adaptive:  # cycles of 0 drafts (plain steps, the proposer caught up later) and 1-2
        assert lengths[0] > 500 and lengths[1] + lengths[2] > 500, lengths
    pvalue = _chi2_pvalue(counts, marginal)
    assert (pvalue > 1e-3) == lossless, pvalue
