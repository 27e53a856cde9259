"""EAGLE and independent baselines: lossless decoding, incremental state, training alignment."""

import functools

import pytest
import torch
from conftest import make_hf_model

from vllm_moa.decoding import EagleProposer, IndependentProposer, SpeculativeEngine, make_proposer
from vllm_moa.model import TargetInfo
from vllm_moa.model.baselines import EagleDrafter, IndependentDrafter
from vllm_moa.model.masks import bounded_memory_limits
from vllm_moa.model.presets import make_eagle_config, make_independent_config
from vllm_moa.target import HFTarget
from vllm_moa.training.data import Example, collate
from vllm_moa.training.losses import masked_kl
from vllm_moa.training.methods import EagleMethod, IndependentMethod

VOCAB = 12  # small, so random drafts are often right and every acceptance path runs
PROMPTS = [[1, 5, 3], [7] * 9, list(range(12)) * 2]


@functools.cache
def _target():
    return HFTarget(make_hf_model(vocab_size=VOCAB, seed=11))


@pytest.fixture(scope="module")
def target():
    return _target()


def _distil(method, target, steps=60):
    """A few steps of KL distillation on the target's own greedy continuations, so the drafts
    are often right and the accept-some / accept-all branches run."""
    gen = torch.Generator().manual_seed(0)
    seqs = []
    for _ in range(8):
        prompt = torch.randint(0, VOCAB, (4,), generator=gen).tolist()
        seqs.append(prompt + SpeculativeEngine(target).generate(prompt, 28).token_ids)
    batch = collate([Example(s, [True] * len(s), 4) for s in seqs])
    with torch.no_grad():
        target_out = target.forward_batch(batch.input_ids, method.hidden_layers)
    limits = torch.arange(batch.input_ids.shape[1]).expand_as(batch.input_ids)
    opt = torch.optim.AdamW(method.model.parameters(), lr=3e-3)
    for _ in range(steps):
        out = method.forward(batch, target_out, limits, None)
        mask = batch.loss_mask & (out.valid if out.valid is not None else True)
        masked_kl(target_out.logits, out.logits, mask).backward()
        opt.step()
        opt.zero_grad()
    return method.model.eval()


@functools.cache
def _trained(kind):
    target = _target()
    info = TargetInfo(target.shape, target.config.num_attention_heads)
    if kind == "eagle":
        d = EagleDrafter(make_eagle_config(info, "small"))
        d.init_weights(0)
        return _distil(EagleMethod(d, target, 0.0), target)
    d = IndependentDrafter(make_independent_config(info, "small"))
    d.init_weights(0)
    return _distil(IndependentMethod(d, target), target)


def _drafter(kind, target, seed=0):
    return _trained(kind)


@pytest.mark.parametrize("kind", ["eagle", "independent"])
@pytest.mark.parametrize("k", [1, 3, 6])
def test_greedy_equality(target, kind, k):
    proposer = make_proposer(_drafter(kind, target), target)
    assert isinstance(proposer, EagleProposer if kind == "eagle" else IndependentProposer)
    accepted = 0
    for prompt in PROMPTS:
        plain = SpeculativeEngine(target).generate(prompt, 30).token_ids
        result = SpeculativeEngine(target, proposer).generate(prompt, 30, num_speculative_tokens=k)
        assert result.token_ids == plain
        accepted += result.stats.num_accepted_tokens
    assert accepted > 0


def _record(proposer):
    cycles = []
    original = proposer.propose

    def recording(last, k, params, gen):
        prefix = list(proposer.tokens)
        proposal = original(last, k, params, gen)
        cycles.append((len(prefix), proposal))
        return proposal

    proposer.propose = recording
    return cycles


@pytest.mark.parametrize("kind", ["eagle", "independent"])
def test_training_forward_equals_inference_drafts(target, kind):
    """Under the K-bounded memory limits of a real generation, the training forward (EAGLE:
    unrolled over stale steps) reproduces the drafts' logits where the drafts were accepted."""
    drafter = _drafter(kind, target)
    method = (
        EagleMethod(drafter, target, 0.0) if kind == "eagle" else IndependentMethod(drafter, target)
    )
    checked = accepted = 0
    for prompt in ([2, 9, 4, 4], [0, 11, 6, 1], *PROMPTS):
        proposer = make_proposer(drafter, target)
        cycles = _record(proposer)
        result = SpeculativeEngine(target, proposer).generate(prompt, 40, num_speculative_tokens=4)
        seq = prompt + result.token_ids
        limits = torch.arange(len(seq))
        checks = []
        for p, proposal in cycles:
            n = 0
            while (
                n < len(proposal.tokens)
                and p + 1 + n < len(seq)
                and (proposal.tokens[n] == seq[p + 1 + n])
            ):
                n += 1
            accepted += n
            for i in range(min(n + 1, len(proposal.tokens))):
                limits[p + i] = p
                checks.append((p + i, proposal.logits[i]))
        batch = collate([Example(seq, [True] * len(seq), len(prompt))])
        with torch.no_grad():
            target_out = target.forward_batch(batch.input_ids, method.hidden_layers)
            out = method.forward(batch, target_out, limits[None], None)
        for pos, row in checks:
            torch.testing.assert_close(out.logits[0, pos], row, atol=1e-4, rtol=1e-4)
        checked += len(checks)
    assert accepted > 5 and checked > 0


def test_eagle_unroll_is_needed(target):
    """Control: with fresh limits (no unrolling) the EAGLE forward differs at stale steps."""
    drafter = _drafter("eagle", target, seed=3)
    method = EagleMethod(drafter, target, 0.0)
    seq = PROMPTS[2] + [3, 4, 5, 6, 7, 8]
    batch = collate([Example(seq, [True] * len(seq), len(PROMPTS[2]))])
    with torch.no_grad():
        target_out = target.forward_batch(batch.input_ids, method.hidden_layers)
        fresh = method.forward(batch, target_out, torch.arange(len(seq))[None], None)
        bounded = bounded_memory_limits(len(seq), len(PROMPTS[2]), 4)[None]
        stale = method.forward(batch, target_out, bounded, None)
    same = torch.isclose(fresh.logits, stale.logits, atol=1e-5).all(-1)[0]
    assert same[: len(PROMPTS[2]) + 1].all() and not same.all()
