"""MoA serving real requests on a GPU page layout: vLLM's FLEX_ATTENTION backend on the CPU
(flex_on_cpu.py), whose caches have the [blocks, heads, block, 2 x head size] layout of the GPU
backends. The proposer reads the target's K/V with the GPU-layout reader, keeps its own pages
through `page_views` + the PyTorch paged attention, and TLI runs the target's layers with the
FLEX_ATTENTION metadata builder; greedy outputs equal plain decoding on the same backend, drafts
are accepted, and plain decoding there equals plain decoding on CPU_ATTN."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.vllm_integration.conftest import run_script
from tests.vllm_integration.test_vllm_offline import PROMPTS

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.fixed_k]  # K every step

SCRIPT = """
import json, sys
flex = sys.argv[3] == "flex"
if flex:
    from tests.vllm_integration.flex_on_cpu import install
    install()
from vllm import LLM, SamplingParams
target, drafter = sys.argv[1], sys.argv[2]
spec = None if drafter == "-" else {"method": "moa", "model": drafter, "num_speculative_tokens": 3}
llm = LLM(model=target, dtype="float32", enforce_eager=True, max_model_len=512, seed=0,
          speculative_config=spec, disable_log_stats=False, num_gpu_blocks_override=96,
          block_size=32)
outs = llm.generate(json.loads(sys.argv[4]), SamplingParams(temperature=0.0, max_tokens=24))
accepted = sum(getattr(m, "value", 0) or 0 for m in llm.get_metrics()
               if m.name == "vllm:spec_decode_num_accepted_tokens")
print("RESULT " + json.dumps({"tokens": [list(o.outputs[0].token_ids) for o in outs],
                              "accepted": accepted}))
"""


def _generate(
    target: Path, drafter: Path | None, backend: str, kernels: str = "0", prompts: int = 4
) -> tuple[dict, str]:
    env = {
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_MOA_KERNELS": kernels,
    }
    args = (target, drafter or "-", backend, json.dumps(PROMPTS[:prompts]))
    return run_script(SCRIPT, *args, env=env)


def test_moa_on_the_gpu_page_layout_equals_plain_decoding(moa_pair):
    plain, _ = _generate(moa_pair["target"], None, "flex")
    reference, _ = _generate(moa_pair["target"], None, "cpu")
    assert plain["tokens"] == reference["tokens"]
    for tli in (0, 1):
        got, log = _generate(moa_pair["target"], moa_pair[f"tli{tli}"], "flex")
        assert "backend FLEX_ATTENTION" in log, "the proposer did not run on the GPU layout"
        assert "sa TorchPagedKV" in log
        assert got["tokens"] == plain["tokens"], f"TLI={tli}"
        assert got["accepted"] > 0, f"TLI={tli}: the trained drafter should land drafts"


def test_moa_with_the_triton_kernels_on_the_gpu_page_layout(moa_pair):
    """What a CUDA GPU runs (the kernels on: LSA's input gathered by `paged_layer_kv`, LSA by
    `layer_attention`, SA / CA over the drafter's pages by the paged kernel, `TritonPagedKV`),
    here under Triton's interpreter: the same greedy tokens as plain decoding."""
    plain, _ = _generate(moa_pair["target"], None, "flex", prompts=2)
    got, log = _generate(moa_pair["target"], moa_pair["tli0"], "flex", kernels="1", prompts=2)
    assert "backend FLEX_ATTENTION" in log
    assert "sa TritonPagedKV" in log and "memory TritonPagedKV" in log
    assert got["tokens"] == plain["tokens"]
    assert got["accepted"] > 0
