"""`vllm serve` with MoA on vLLM's V2 model runner (through the CPU harness, v2_on_cpu.py): the
API server and the engine core are separate processes, both with the harness from start-up; the
OpenAI client gets plain greedy decoding's text and the server's metrics count accepted drafts."""

from __future__ import annotations

import os
import sys
import urllib.request
from pathlib import Path

import pytest

from tests.deps import need
from tests.servers import serving
from tests.vllm_integration import v2_on_cpu

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_vllm_serve_on_v2_with_the_openai_client(moa_pair, tmp_path):
    openai = need("openai")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log = tmp_path / "server.log"
    vllm = Path(sys.executable).with_name("vllm")

    def cmd(port: int) -> list[str]:
        return [
            str(vllm), "serve", str(moa_pair["target"]), "--served-model-name", "tiny",
            "--port", str(port), "--host", "127.0.0.1", "--dtype", "float32",
            "--max-model-len", "512", "--enforce-eager",
            "--spec-method", "moa", "--spec-model", str(moa_pair["tli1"]), "--spec-tokens", "4",
        ]  # fmt: skip

    env = {**os.environ, **v2_on_cpu.env(VLLM_CPU_KVCACHE_SPACE="1")}
    with serving(cmd, env, log, wait=300) as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key="none")
        prompt = "def fibonacci(n):\n"
        out = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0)
        with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
            metrics = r.read().decode()
    text = log.read_text()
    assert "MoA runs on vLLM's V2 model runner" in text, "the engine core did not run V2"
    tok = AutoTokenizer.from_pretrained(moa_pair["target"])
    model = AutoModelForCausalLM.from_pretrained(moa_pair["target"])
    ids = tok(prompt, return_tensors="pt").input_ids
    ref = model.generate(ids, max_new_tokens=24, do_sample=False)[0, ids.shape[1] :]
    assert out.choices[0].text == tok.decode(ref, skip_special_tokens=True)
    accepted = [
        float(line.split()[-1])
        for line in metrics.splitlines()
        if line.startswith("vllm:spec_decode_num_accepted_tokens_total")
    ]
    assert accepted and accepted[0] > 0, "no draft accepted"
