"""The incremental MoA proposer equals a from-scratch recompute, and LSA sees each token once."""

import pytest
import torch
from conftest import OracleMoAProposer, make_drafter

from vllm_moa.decoding import SamplingParams, SpeculativeEngine
from vllm_moa.hf_target import HFTarget

# The speculative machinery at a known K, drafting every cycle (test_adaptive.py: the rule).
pytestmark = pytest.mark.fixed_k

# fp32 tiny models; incremental vs recomputed differ by summation order only.
TOL = dict(atol=1e-4, rtol=1e-4)
PROMPT = [3, 17, 99, 42, 7, 250, 8, 61, 5]


class Recording(OracleMoAProposer):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.cycles = []

    def propose(self, last_token, num_tokens, params, generator):
        prefix, start = list(self.tokens), len(self.raw_log)
        proposal = super().propose(last_token, num_tokens, params, generator)
        raw = torch.stack(self.raw_log[start:])
        self.cycles.append((prefix, last_token, proposal, raw))
        return proposal


def _run(llama_target, tli, k=4, max_new=30):
    drafter = make_drafter(llama_target, tli=tli)
    proposer = Recording(drafter, llama_target, corrupt_every=4)
    result = SpeculativeEngine(llama_target, proposer).generate(
        PROMPT, max_new, num_speculative_tokens=k
    )
    return drafter, proposer, result


@pytest.mark.parametrize("tli", [0, 1, 2])
def test_incremental_drafting_equals_fresh_recompute(llama_target, tli):
    drafter, proposer, result = _run(llama_target, tli)
    assert len(proposer.cycles) >= 5
    hist = result.stats.accepted_length_histogram
    assert hist[0] and sum(hist[1:]), f"want both rejections and acceptances, got {hist}"
    fresh_target = HFTarget(llama_target.model)  # same weights, its own cache
    for prefix, last, proposal, _raw in proposer.cycles:
        fresh = OracleMoAProposer(drafter, fresh_target, corrupt_every=4)
        fresh_target.reset()
        fresh.start(prefix, fresh_target.forward(torch.tensor(prefix)))
        again = fresh.propose(last, len(proposal.tokens), SamplingParams(), None)
        assert again.tokens == proposal.tokens
        torch.testing.assert_close(again.logits, proposal.logits, **TOL)


def test_incremental_equals_full_sequence_forward(llama_target):
    drafter, proposer, result = _run(llama_target, tli=0)
    seq = PROMPT + result.token_ids
    full = llama_target  # reuse: reset and run the whole final sequence
    full.reset()
    kv = full.forward(torch.tensor(seq)).layer_kv
    limits = torch.arange(len(seq))
    checks = []
    for prefix, _last, proposal, raw in proposer.cycles:
        p = len(prefix)
        accepted = 0
        while (
            accepted < len(proposal.tokens)
            and p + 1 + accepted < len(seq)
            and (proposal.tokens[accepted] == seq[p + 1 + accepted])
        ):
            accepted += 1
        # Queries at p..p+accepted had the sequence's own tokens and saw memory rows < p.
        for i in range(min(accepted + 1, len(proposal.tokens))):
            limits[p + i] = p
            checks.append((p + i, raw[i]))
    embeds = full.embed(torch.tensor(seq))[None]
    with torch.no_grad():
        hidden = drafter(embeds, kv[None], limits)[0]
        logits = full.lm_logits(hidden)
    for pos, row in checks:
        torch.testing.assert_close(logits[pos], row, **TOL)


def test_each_token_passes_through_lsa_exactly_once(llama_target):
    drafter = make_drafter(llama_target, tli=1)
    seen = []
    handle = drafter.layer_self_attention.register_forward_hook(
        lambda mod, args, out: seen.append(args[0].detach().clone())
    )
    try:
        proposer = Recording(drafter, llama_target, corrupt_every=3)
        result = SpeculativeEngine(llama_target, proposer).generate(
            PROMPT, 25, num_speculative_tokens=3
        )
    finally:
        handle.remove()
    # One LSA call at prefill, then one per verification cycle, never per draft step.
    assert len(seen) == 1 + len(proposer.cycles)
    verified = proposer.verified_len
    assert sum(x.shape[0] for x in seen) == verified  # no row twice, none missed
    llama_target.reset()
    seq = (PROMPT + result.token_ids)[:verified]
    expected = llama_target.forward(torch.tensor(seq)).layer_kv
    # ... and in order: the rows are exactly the target's K|V of positions 0..verified-1.
    torch.testing.assert_close(torch.cat(seen), expected, atol=1e-5, rtol=1e-5)
