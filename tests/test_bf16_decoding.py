"""Greedy speculative decoding in bfloat16 (the CLI's default dtype on CUDA), on the CPU.

In bf16 a verify pass (several tokens at once) and plain decoding's one-token step compute the
same logits through different matrix shapes, so they round differently: here by up to 2.5 units
in the last place of the best logit (a bf16 unit at 0.5-1 is 2^-8; this random tiny model's best
logits are about 0.6). Where plain decoding's top two logits are closer than the two differences
together (and this model has many exact bf16 ties), speculative decoding may legitimately take
the other token, and from there the two texts go their own ways. So the check is made along the
speculative text itself, for every token: plain bf16 decoding's one-token step, run over the
text emitted so far, ranks the emitted token first, or within NEAR_TIE_ULPS bf16 units of its
first (a near tie: twice the bound NOISE_ULPS on the rounding difference, which a test checks).
And most sequences are plain decoding's, token for token. A verifier that accepts drafts without
comparing them fails the same check (the control).
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import OracleMoAProposer, make_drafter, make_hf_model

import vllm_moa.decoding.engine as engine_module
from vllm_moa.decoding import SpeculativeEngine
from vllm_moa.decoding.sampling import Verdict
from vllm_moa.decoding.tree import TreeParams
from vllm_moa.drafters.moa.proposer import MoAProposer
from vllm_moa.hf_target import HFTarget

pytestmark = pytest.mark.fixed_k  # K every cycle

VOCAB = 128
PROMPTS = [
    torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(n)).tolist()
    for n in (1, 4, 7, 11, 17, 23, 31, 40)
]
NEW_TOKENS = 32
# How far a multi-token pass's logits may be from the one-token step's, in bf16 units at the best
# logit's magnitude (measured: 2.5); a near tie: the best logit at most twice that above the
# emitted token's (each of the two may be off by NOISE_ULPS).
NOISE_ULPS = 4
NEAR_TIE_ULPS = 2 * NOISE_ULPS


def bf16_ulp(x: float) -> float:
    """The spacing of bf16 numbers at |x| (8 significant bits)."""
    return 2.0 ** (math.floor(math.log2(max(abs(x), 2.0**-126))) - 7)


@pytest.fixture(scope="module")
def bf16_target() -> HFTarget:
    target = HFTarget(make_hf_model("llama", vocab_size=VOCAB).to(torch.bfloat16))
    assert target.dtype == torch.bfloat16
    return target


@pytest.fixture(scope="module")
def plain_bf16(bf16_target) -> list[list[int]]:
    engine = SpeculativeEngine(bf16_target)
    return [engine.generate(p, NEW_TOKENS).token_ids for p in PROMPTS]


def plain_step_logits(target: HFTarget, prompt: list[int], emitted: list[int]) -> torch.Tensor:
    """[len(emitted), V] float32: the logits plain decoding's step computes before each emitted
    token, run along `emitted` (the prompt's pass, then one token at a time, as the engine's
    plain decoding does)."""
    target.reset()
    rows = [target.forward(torch.tensor(prompt)).logits[-1]]
    for token in emitted[:-1]:
        rows.append(target.forward(torch.tensor([token])).logits[-1])
    return torch.stack(rows).float()


def check_as_plain_bf16(
    target: HFTarget, engine: SpeculativeEngine, plain: list[list[int]], **generate
) -> int:
    """Every emitted token is plain bf16 decoding's choice at its context or a near tie of it,
    and most sequences equal plain decoding; returns the drafts accepted."""
    equal, near_ties, accepted = 0, [], 0
    for prompt, expected in zip(PROMPTS, plain, strict=True):
        result = engine.generate(prompt, NEW_TOKENS, **generate)
        accepted += result.stats.num_accepted_tokens
        emitted = result.token_ids
        assert len(emitted) == NEW_TOKENS
        logits = plain_step_logits(target, prompt, emitted)
        for i, token in enumerate(emitted):
            best = float(logits[i].max())
            gap = best - float(logits[i, token])
            assert gap <= NEAR_TIE_ULPS * bf16_ulp(best), (
                f"prompt of {len(prompt)}, token {i}: {token} is {gap:.4g} below plain "
                f"decoding's best {int(logits[i].argmax())} ({best:.4g}), more than a near tie"
            )
            if token != int(logits[i].argmax()):
                near_ties.append((len(prompt), i, gap))
        equal += emitted == expected
    # A near tie taken differently sends the text elsewhere; most texts meet none.
    assert equal >= len(PROMPTS) - 2, f"{equal} of {len(PROMPTS)} equal plain decoding"
    assert len(near_ties) <= 2, f"near ties taken otherwise: {near_ties}"
    return accepted


def test_plain_bf16_steps_are_the_reference(bf16_target, plain_bf16):
    """The reference above is plain decoding: along plain decoding's own text, its step logits
    rank every emitted token first. And the premise of the near-tie tolerance: passes of 2, 5
    (K=4's verify) and 9 tokens (a tree's) give those logits within NOISE_ULPS bf16 units."""
    worst = 0.0
    for prompt, expected in zip(PROMPTS, plain_bf16, strict=True):
        steps = plain_step_logits(bf16_target, prompt, expected)
        assert steps.argmax(dim=-1).tolist() == expected
        units = torch.tensor([bf16_ulp(float(b)) for b in steps.max(dim=-1).values])
        for size in (2, 5, 9):
            bf16_target.reset()
            rows = [bf16_target.forward(torch.tensor(prompt)).logits[-1:]]
            for i in range(0, len(expected) - 1, size):
                rows.append(bf16_target.forward(torch.tensor(expected[i : i + size])).logits)
            passes = torch.cat(rows)[: len(expected)].float()
            worst = max(worst, float(((passes - steps).abs().amax(dim=-1) / units).max()))
    assert worst <= NOISE_ULPS, f"passes differ from steps by {worst:.2f} bf16 units"


@pytest.mark.parametrize("tli", [0, 1])
def test_bf16_greedy_speculative_is_plain_decoding(bf16_target, plain_bf16, tli):
    """A bf16 MoA drafter (TLI 0: the drafter alone; TLI 1: the target's last layer in bf16) on
    a bf16 target, drafts made to land by an oracle bonus, K=4; and the drafter's own drafts as
    EAGLE-2 trees (verified by the tree verifier)."""
    drafter = make_drafter(bf16_target, tli=tli, seed=tli).to(torch.bfloat16)
    oracle = SpeculativeEngine(bf16_target, OracleMoAProposer(drafter, bf16_target))
    accepted = check_as_plain_bf16(bf16_target, oracle, plain_bf16, num_speculative_tokens=4)
    assert accepted >= 100, "the oracle's drafts should mostly land"
    trees = SpeculativeEngine(bf16_target, MoAProposer(drafter, bf16_target))
    check_as_plain_bf16(
        bf16_target, trees, plain_bf16, tree=TreeParams(depth=3, breadth=2, budget=8)
    )


def test_control_accepting_unchecked_drafts_fails(bf16_target, plain_bf16, monkeypatch):
    """Control: a greedy verifier that accepts every draft without comparing it to the target's
    choice emits the drafter's tokens, and the check above fails."""

    def accept_all(draft: list[int], target_logits: torch.Tensor) -> Verdict:
        return Verdict(len(draft), int(target_logits[len(draft)].argmax()))

    monkeypatch.setattr(engine_module, "verify_greedy", accept_all)
    drafter = make_drafter(bf16_target, tli=0).to(torch.bfloat16)
    engine = SpeculativeEngine(bf16_target, MoAProposer(drafter, bf16_target))
    with pytest.raises(AssertionError, match="more than a near tie"):
        check_as_plain_bf16(bf16_target, engine, plain_bf16, num_speculative_tokens=4)
