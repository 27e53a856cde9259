"""An inflated pair (`vllm-moa inflate`) decodes and drafts in vLLM exactly as the original: the
same outputs, the same chain drafted at every context (traced), the same acceptance. Control: a
drafter widened wrong (its norms not rescaled) beside a target widened right still decodes the
same (vLLM's verifier sees to that) but drafts other chains, and the same check fails."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.vllm_integration.chains import traced_chains
from tests.vllm_integration.conftest import greedy, make_llm, spec_metrics

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.fixed_k]  # K every step

PROMPTS = ["def fibonacci(n):\n", "import os\n\ndef read_file(path):\n", "for i in range(10):\n"]


WIDE = {"hidden": 256, "intermediate": 512, "heads": 4}


def _run(target, drafter, trace):
    """(outputs, spec-decode metrics, {context: chain drafted}) of greedy PROMPTS, traced."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_MOA_TRACE", str(trace))
        llm = make_llm(target, drafter, k=4)
        outs = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy())]
        metrics = spec_metrics(llm)
        del llm
    return outs, metrics, traced_chains(trace)


@pytest.fixture(scope="module")
def original(moa_pair, tmp_path_factory):
    """The original pair's run (MoA TLI=1)."""
    return _run(moa_pair["target"], moa_pair["tli1"], tmp_path_factory.mktemp("orig") / "t.jsonl")


def check_same_run(want, got) -> None:
    """Outputs, every drafted chain (at the same contexts) and acceptance equal."""
    assert got[0] == want[0], "outputs differ"
    assert got[2] == want[2], "the inflated drafter drafts other chains"
    for name in ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_accepted_tokens"):
        assert got[1][name] == want[1][name], name


def test_inflated_pair_equals_the_original_in_vllm(moa_pair, original, tmp_path):
    out = tmp_path / "wide"
    cmd = [
        sys.executable, "-m", "vllm_moa.cli.main", "inflate",
        "--target", str(moa_pair["target"]), "--drafter", str(moa_pair["tli1"]),
        "--hidden-size", str(WIDE["hidden"]), "--intermediate-size", str(WIDE["intermediate"]),
        "--num-heads", str(WIDE["heads"]), "--out", str(out),
    ]  # fmt: skip
    subprocess.run(cmd, check=True)
    got = _run(out / "target", out / "drafters" / "tli1", tmp_path / "wide.jsonl")
    assert original[1]["vllm:spec_decode_num_accepted_tokens"] > 0
    check_same_run(original, got)


def test_control_a_wrong_drafter_widening_fails(moa_pair, original, tmp_path, monkeypatch):
    """Control: the target widened right, the drafter with its norms not rescaled (as
    tests/test_inflate.py's control): the outputs are still the original's, the check fails."""
    from vllm_moa.checkpoint.inflate import Widening, inflate_drafter, inflate_target

    widening = inflate_target(moa_pair["target"], tmp_path / "target", **WIDE)
    monkeypatch.setattr(Widening, "norm_scale", property(lambda w: 1.0))
    drafter = inflate_drafter(moa_pair["tli1"], tmp_path / "tli1", widening)
    got = _run(tmp_path / "target", drafter, tmp_path / "wide.jsonl")
    assert got[0] == original[0], "vLLM's verifier keeps the outputs whatever is drafted"
    with pytest.raises(AssertionError, match="other chains"):
        check_same_run(original, got)
