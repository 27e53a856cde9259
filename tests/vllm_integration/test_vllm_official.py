"""A drafter released by the MoA authors, converted by `vllm-moa convert-official`, served by
vLLM: the published (moa_spec) layout of the golden fixtures made with the authors' own code
(tests/data/official/lsa64: a 3-layer target with heads of 32, rope_theta 500000; lsa64_llama3:
the same with Llama-3.1's RoPE scaling past position 16, which the drafter's SA applies),
converted for TLI 0 and 1, gives plain decoding's greedy output in vLLM, and every chain vLLM
drafts equals the standalone proposer's at its context (the random release lands few drafts:
the chain check, not acceptance, shows the converted drafter runs as converted)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.vllm_integration.chains import reference_chains
from tests.vllm_integration.conftest import greedy, make_llm

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.fixed_k]  # K every step

FIXTURES = Path(__file__).resolve().parents[1] / "data" / "official"
PROMPTS = [[1, 5, 9, 13, 17, 21, 25, 29], [2, 4, 8, 16, 32, 3, 6], [7, 7, 7, 11, 11, 11]]


@pytest.mark.parametrize("tli", [0, 1])
@pytest.mark.parametrize("geometry", ["lsa64", "lsa64_llama3"])  # the latter: llama3 RoPE scaling
def test_a_converted_release_serves_in_vllm(tmp_path, monkeypatch, geometry, tli):
    from vllm_moa.checkpoint import ConvertOptions, convert_official
    from vllm_moa.hf_target import load_target_info

    fixture = FIXTURES / geometry
    target = fixture / "target"
    options = ConvertOptions(tli=tli, target=load_target_info(target))
    drafter = convert_official(fixture / "release_moa_spec", tmp_path / "drafter", options)
    limits = {"max_model_len": 64, "skip_tokenizer_init": True}
    requests = [{"prompt_token_ids": p} for p in PROMPTS]
    plain = make_llm(target, **limits)
    expected = [list(o.outputs[0].token_ids) for o in plain.generate(requests, greedy(16))]
    del plain
    trace = tmp_path / "trace.jsonl"
    monkeypatch.setenv("VLLM_MOA_TRACE", str(trace))
    llm = make_llm(target, Path(drafter), k=3, **limits)
    got = [list(o.outputs[0].token_ids) for o in llm.generate(requests, greedy(16))]
    assert got == expected
    traced = {}
    for line in trace.read_text().splitlines():
        rec = json.loads(line)
        traced[tuple(rec["tokens"])] = rec["drafts"]
    assert len(traced) >= 3 * 4, "too few drafting steps"
    reference = reference_chains(target, Path(drafter), list(traced), 3)
    wrong = [c for c, chain in traced.items() if chain != reference[c][: len(chain)]]
    assert not wrong, f"{len(wrong)} of {len(traced)} chains differ from the standalone proposer"
