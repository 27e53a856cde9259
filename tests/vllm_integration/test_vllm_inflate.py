"""An inflated pair (`vllm-moa inflate`) decodes and drafts in vLLM exactly as the original."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.vllm_integration.conftest import greedy, make_llm, spec_metrics

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.fixed_k]  # K every step

PROMPTS = ["def fibonacci(n):\n", "import os\n\ndef read_file(path):\n", "for i in range(10):\n"]


def _run(target, drafter):
    llm = make_llm(target, drafter, k=4)
    outs = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy())]
    metrics = spec_metrics(llm)
    del llm
    return outs, metrics


def test_inflated_pair_equals_the_original_in_vllm(moa_pair, tmp_path):
    out = tmp_path / "wide"
    cmd = [
        sys.executable, "-m", "vllm_moa.cli.main", "inflate",
        "--target", str(moa_pair["target"]), "--drafter", str(moa_pair["tli1"]),
        "--hidden-size", "256", "--intermediate-size", "512", "--num-heads", "4",
        "--out", str(out),
    ]  # fmt: skip
    subprocess.run(cmd, check=True)
    want, want_metrics = _run(moa_pair["target"], moa_pair["tli1"])
    got, got_metrics = _run(out / "target", out / "drafters" / "tli1")
    assert got == want
    for name in ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_accepted_tokens"):
        assert got_metrics[name] == want_metrics[name], name
