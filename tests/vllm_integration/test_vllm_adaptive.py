"""Adaptive speculation inside vLLM: a drafter that never matches stops drafting; the drafts
that do land are kept when drafting is cheap; outputs equal plain decoding either way; and
VLLM_MOA_ADAPTIVE=0 or the key "moa_adaptive": false restores the fixed K. Drafting is read
from vLLM's own spec-decode counters (draft tokens per generated token: about K with a fixed K
and a useless drafter). A drafter that always matches keeping K is tested in the standalone
engine (tests/test_adaptive.py), where an oracle drafter exists."""

from __future__ import annotations

import pytest

from tests.costs import fixed_costs
from tests.vllm_integration.conftest import greedy, make_llm, spec_metrics
from tests.vllm_integration.test_vllm_offline import PROMPTS

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

K = 4
MAX_TOKENS = 48


def injected_costs(monkeypatch) -> None:
    """The proposer's costs replaced (a draft step 1/20 of a target step); the guard off, so
    that the injected model decides alone (the guard would measure this CPU's real times)."""
    from vllm_moa.adaptive import DraftGuard
    from vllm_moa.vllm_plugin import proposer

    monkeypatch.setattr(proposer, "StepCosts", fixed_costs(0.001))
    monkeypatch.setattr(proposer, "DraftGuard", lambda: DraftGuard(enabled=False))


@pytest.fixture(scope="module")
def plain(moa_pair):
    llm = make_llm(moa_pair["target"])
    out = [o.outputs[0].token_ids for o in llm.generate(PROMPTS * 2, greedy(MAX_TOKENS))]
    del llm
    return out


def drafting(moa_pair, drafter, plain, **spec_keys) -> tuple[float, int]:
    """(draft tokens per generated token, accepted tokens) for 20 concurrent greedy requests,
    after checking the outputs equal plain decoding."""
    llm = make_llm(moa_pair["target"], drafter, k=K, spec_keys=spec_keys)
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS * 2, greedy(MAX_TOKENS))]
    assert got == plain
    m = spec_metrics(llm)
    del llm
    draft_tokens = m["vllm:spec_decode_num_draft_tokens"]
    accepted = m.get("vllm:spec_decode_num_accepted_tokens", 0)
    return draft_tokens / (len(plain) * MAX_TOKENS), accepted


def test_a_drafter_that_never_matches_stops_drafting(moa_pair, random_drafter, plain,
                                                     monkeypatch):  # fmt: skip
    monkeypatch.setenv("VLLM_MOA_ADAPTIVE", "1")  # the default, said explicitly
    adaptive, _ = drafting(moa_pair, random_drafter, plain)
    monkeypatch.setenv("VLLM_MOA_ADAPTIVE", "0")
    fixed, accepted = drafting(moa_pair, random_drafter, plain)
    assert accepted < 0.05 * fixed * len(plain) * MAX_TOKENS, "the drafter should land ~nothing"
    assert fixed > 2.5, f"fixed K drafts ~K per generated token, got {fixed:.2f}"
    assert adaptive < 0.25 * fixed, (adaptive, fixed)


def test_drafts_that_land_are_kept_when_drafting_is_cheap(moa_pair, plain, monkeypatch):
    """The trained test drafter (it lands few drafts on these prompts: 3% at K=4, mostly in
    repetitive stretches), with the measured costs replaced by a draft step 20x cheaper than
    the target step: adaptive drafting keeps most of the accepted tokens for far fewer drafts."""

    injected_costs(monkeypatch)
    monkeypatch.setenv("VLLM_MOA_ADAPTIVE", "1")
    adaptive, adaptive_accepted = drafting(moa_pair, moa_pair["tli0"], plain)
    # The fixed K through the --speculative-config key this time.
    fixed, fixed_accepted = drafting(moa_pair, moa_pair["tli0"], plain, moa_adaptive=False)
    assert fixed_accepted > 40, "the trained drafter should land some drafts"
    assert adaptive_accepted > 0.6 * fixed_accepted, (adaptive_accepted, fixed_accepted)
    assert adaptive < 0.5 * fixed, (adaptive, fixed)


def test_vllms_batch_size_schedule_caps_the_drafts(moa_pair, plain):
    """vLLM's dynamic speculation schedule (`num_speculative_tokens_per_batch_size`) is
    honoured per step: 20 concurrent requests at a fixed K=4, capped at 1 draft for batches of
    9-64 (then at 4 once fewer than 9 remain), or at 0: outputs stay plain decoding's."""
    fixed, _ = drafting(moa_pair, moa_pair["tli0"], plain, moa_adaptive=False)
    schedule = [[1, 8, 4], [9, 64, 1]]
    capped, _ = drafting(
        moa_pair, moa_pair["tli0"], plain, moa_adaptive=False,
        num_speculative_tokens_per_batch_size=schedule,
    )  # fmt: skip
    off, _ = drafting(
        moa_pair, moa_pair["tli0"], plain, num_speculative_tokens_per_batch_size=[[1, 64, 0]]
    )
    assert fixed > 2.5 and 0 < capped <= 1.0 and off == 0, (fixed, capped, off)


def test_seeded_sampled_requests_get_no_drafts_and_repeat_plain_text(moa_pair, monkeypatch):
    """Seeded requests at temperature > 0 are decoded without drafts under adaptive lengths
    (their draws would follow measured times): plain decoding's text for the seed, every time;
    greedy requests in the same batch still draft (costs made cheap so that they do)."""
    from vllm import SamplingParams

    seeded = [SamplingParams(temperature=1.0, seed=s, max_tokens=24) for s in (1, 2, 3)]
    llm = make_llm(moa_pair["target"])
    plain = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:3], seeded)]
    del llm
    injected_costs(monkeypatch)
    monkeypatch.setenv("VLLM_MOA_ADAPTIVE", "1")
    llm = make_llm(moa_pair["target"], moa_pair["tli0"], k=K)
    for _ in range(2):
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:3], seeded)]
        assert got == plain
    assert not spec_metrics(llm).get("vllm:spec_decode_num_draft_tokens")
    llm.generate(PROMPTS[:3], [greedy(24)] * 3)
    assert spec_metrics(llm)["vllm:spec_decode_num_draft_tokens"] > 0
    del llm
