"""The Triton kernels compile for Hopper (sm_90) and Ampere (sm_80) GPUs, fit, spill no
registers, (16-bit attention) run on the tensor cores and (the gather) load 16 bytes at a time:
checked without a GPU by Triton's compiler and the ptxas it ships (benchmarks/kernels_aot.py
--smoke, in its own process: this test session interprets the kernels, and the build needs them
compiled)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.deps import need

need("triton")
ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_kernels_build_for_hopper_and_ampere(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "aot.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.kernels_aot", "--smoke", "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = result["defaults"]
    built = {(r["kernel"], r["dtype"], r["arch"]) for r in rows}
    kernels = {"_layer_attention_kernel", "_tree_attention_kernel", "_paged_layer_kv_kernel"}
    assert built == {
        (k, d, a) for k in kernels for d in ("fp32", "bf16") for a in ("sm_90", "sm_80")
    }
    for row in rows:
        assert "error" not in row and row["fits"] and row["local_bytes"] == 0, row
    hopper_16bit = [
        r
        for r in rows
        if r["arch"] == "sm_90" and r["dtype"] == "bf16" and "attention" in r["kernel"]
    ]
    assert hopper_16bit and all(r["tensor_core_ops"].get("HGMMA") for r in hopper_16bit)
    # fp32 keeps full-precision products: no tensor cores (TF32 would change fp32 logits)
    assert not any(r["tensor_core_ops"] for r in rows if r["dtype"] == "fp32")
    # the gather (a copy) reads 16 bytes per load
    gathers = [r for r in rows if r["kernel"] == "_paged_layer_kv_kernel"]
    assert all(r["global_loads"].get("LDG.E.128") for r in gathers)
    # controls: the earlier tree default spills, the gather without its alignment hint loads
    # element by element; the check fails both
    tree, gather = result["controls"]
    assert tree["local_bytes"] > 0 and not tree["passes"]
    assert "LDG.E.128" not in gather["global_loads"] and not gather["passes"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the kernels are compiled")
def test_build_refuses_interpreted_kernels():
    """In an interpreting process the build says what to do instead of failing deep in Triton."""
    from benchmarks import triton_aot as aot
    from vllm_moa.kernels import paged_layer_kv as module

    caches = [torch.zeros(2, 1, 16, 32)]
    real = module._paged_layer_kv_kernel
    with aot.capture(module, "_paged_layer_kv_kernel") as launches:
        out = module.paged_layer_kv([caches[0][..., :16]], [caches[0][..., 16:]], torch.arange(3))
    assert module._paged_layer_kv_kernel is real  # restored after the block
    assert out.shape == (3, 1, 32) and len(launches) == 1 and launches[0].grid == (3, 1)
    with pytest.raises(RuntimeError, match="unset TRITON_INTERPRET"):
        aot.build(launches[0], 90)
