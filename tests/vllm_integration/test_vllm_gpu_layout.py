"""MoA serving real requests on a GPU page layout: vLLM's FLEX_ATTENTION backend on the CPU
(flex_on_cpu.py), whose caches have the [blocks, heads, block, 2 x head size] layout of the GPU
backends. The proposer reads the target's K/V with the GPU-layout reader, keeps its own pages
through `page_views` + the PyTorch paged attention, and TLI runs the target's layers with the
FLEX_ATTENTION metadata builder; then the same with the Triton kernels a CUDA GPU runs (here
interpreted). Greedy outputs equal plain decoding (plain decoding on FLEX_ATTENTION too), and
every chain drafted equals the standalone proposer's at its context: with the test pair's TLI=0
drafter and with the sensitive drafter (TLI=1), whose drafts depend on every row it reads
(conftest.py; test_vllm_drafts_check.py shows the check failing when the rows are wrong)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.vllm_integration.chains import (
    ENGINES,
    assert_chains_are_the_standalone_proposers,
    encode,
    fewest_draft_steps,
    moa,
    plain_greedy,
)
from tests.vllm_integration.conftest import run_script
from tests.vllm_integration.test_vllm_offline import PROMPTS

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.fixed_k]  # K every step

K = 3
FLEX = "from tests.vllm_integration.flex_on_cpu import install\ninstall()\n"
LIMITS = {"num_gpu_blocks_override": 96, "block_size": 32}


def run_on_flex(target: Path, prompts: list[list[int]], runs: list[dict]) -> tuple[list, str]:
    """Engines one after another on FLEX_ATTENTION, in one interpreter (chains.py's
    `ENGINES`; the backend installed before the first)."""
    runs = [{"kwargs": LIMITS, **run} for run in runs]
    runs[0]["setup"] = FLEX
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    job = {"target": str(target), "prompts": prompts, "runs": runs}
    return run_script(ENGINES, json.dumps(job), env=env)


def test_moa_on_the_gpu_page_layout_drafts_as_the_standalone_proposer(
    moa_pair, sensitive_drafter, tmp_path
):
    target = moa_pair["target"]
    prompts = encode(target, PROMPTS[:4])
    params = {"temperature": 0.0, "max_tokens": 24, "ignore_eos": True}
    drafters = {"tli0": moa_pair["tli0"], "sensitive": sensitive_drafter}
    runs = [{"params": params, "env": {"VLLM_MOA_KERNELS": "0"}}] + [
        {"spec": moa(d, K), "trace": str(tmp_path / f"{n}.jsonl"), "params": params}
        for n, d in drafters.items()
    ]
    (plain, *drafted), log = run_on_flex(target, prompts, runs)
    assert "backend FLEX_ATTENTION" in log, "the proposer did not run on the GPU layout"
    assert "sa TorchPagedKV" in log
    assert plain["passes"] == [plain_greedy(target, prompts, 24)]
    for (name, drafter), got in zip(drafters.items(), drafted, strict=True):
        assert got["passes"] == plain["passes"], name
        assert got["metrics"]["vllm:spec_decode_num_accepted_tokens"] > 0, name
        assert_chains_are_the_standalone_proposers(
            target, drafter, tmp_path / f"{name}.jsonl", K, fewest_draft_steps(4, 24, K)
        )


def test_moa_with_the_triton_kernels_on_the_gpu_page_layout(moa_pair, sensitive_drafter, tmp_path):
    """What a CUDA GPU runs (the kernels on: LSA's input gathered by `paged_layer_kv`, LSA by
    `layer_attention`, SA / CA over the drafter's pages by the paged kernel, `TritonPagedKV`),
    here under Triton's interpreter: plain decoding's greedy tokens, and the standalone
    proposer's chains."""
    target = moa_pair["target"]
    prompts = encode(target, PROMPTS[:2])
    trace = tmp_path / "kernels.jsonl"
    params = {"temperature": 0.0, "max_tokens": 24, "ignore_eos": True}
    run = {"spec": moa(sensitive_drafter, K), "trace": str(trace), "params": params,
           "env": {"VLLM_MOA_KERNELS": "1"}}  # fmt: skip
    (got,), log = run_on_flex(target, prompts, [run])
    assert "backend FLEX_ATTENTION" in log
    assert "sa TritonPagedKV" in log and "memory TritonPagedKV" in log
    assert got["passes"] == [plain_greedy(target, prompts, 24)]
    assert got["metrics"]["vllm:spec_decode_num_accepted_tokens"] > 0
    # every step drafts (fixed K): at least the fewest steps 2 x 24 tokens allow (12); on an
    # AVX-512 CPU 20+ were seen, on an AVX2 one 14 (more drafts accepted)
    assert_chains_are_the_standalone_proposers(
        target, sensitive_drafter, trace, K, fewest_draft_steps(2, 24, K)
    )
