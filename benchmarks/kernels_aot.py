"""Compile every Triton kernel for CUDA GPUs without one, and report what each build needs.

    python -m benchmarks.kernels_aot --out benchmarks/results/kernels/kernels_aot.json

For each kernel at real model shapes (Llama-3-8B, a Qwen2-7B-like 7-heads-per-group layout,
Llama-3-70B's 64 heads, head size 64), each dtype (fp32, fp16, bf16) and each architecture
(sm_90: H100/H200, sm_80: A100), the wrapper's default launch is built to a cubin as Triton's JIT
would build it on that GPU (`benchmarks/triton_aot.py`): registers and spills per thread, dynamic
shared memory against the per-block limit, tensor-core instructions in the SASS. Then the tile
sweep of `benchmarks/kernels_gpu.py` (Llama-3-8B, bf16, sm_90), so a GPU session's timings can
be read beside each setting's resources. A default build passes when it fits, spills nothing,
and (attention kernels, 16-bit) runs its products on the tensor cores, the gather (a copy)
reading 16 bytes per load; two controls (the tree kernel's earlier default, which spills; the
gather without its alignment hint) must fail. No GPU needed; timing is
`benchmarks/kernels_gpu.py`'s job. `--smoke`: Llama-3-8B, fp32 and bf16 only (tests).
Runs in its own process: the kernels must be compiled, not interpreted (TRITON_INTERPRET unset).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
ARCHS = (90, 80)

# (query heads, KV heads, layers, head size): LSA's layer attention at the paper preset's
# widths (kernels_gpu.py: 32 heads / 8 KV heads of 64) and a 7-heads-per-group, 28-layer one
LAYER_SHAPES: dict[str, tuple[int, ...]] = {
    "llama3-8b": (32, 8, 32, 64),
    "qwen2-7b": (28, 4, 28, 64),
}
# (query heads, KV heads, head size) of the target's attention in tree verification
TREE_SHAPES: dict[str, tuple[int, ...]] = {
    "llama3-8b": (32, 8, 128),
    "qwen2-7b": (28, 4, 128),
    "llama3-70b": (64, 8, 128),
    "llama3.2-1b": (32, 8, 64),
}
# (layers, KV heads, head size) of the target's paged caches LSA reads
GATHER_SHAPES: dict[str, tuple[int, ...]] = {"llama3-8b": (32, 8, 128), "qwen2-7b": (28, 4, 128)}


def layer_launch(shape: tuple[int, ...], dtype: torch.dtype, **tiles: int):
    from benchmarks import triton_aot as aot
    from vllm_moa.kernels import layer_attention as module

    h, hkv, layers, d = shape
    q = torch.zeros(4, h, layers, d, dtype=dtype)
    kv = torch.zeros(4, hkv, layers, d, dtype=dtype)
    with aot.capture(module, "_layer_attention_kernel") as launches:
        module.layer_attention(q, kv, kv, **tiles)
    return launches[0]


def tree_launch(shape: tuple[int, ...], dtype: torch.dtype, **tiles: Any):  # block_m, ...: int
    from benchmarks import triton_aot as aot
    from vllm_moa.kernels import tree_attention as module

    h, hkv, d = shape
    m, block, pages = 62, 16, 64  # the paper's 62-node trees over a 1024-token prefix
    mask = torch.tril(torch.ones(1, m, m, dtype=torch.bool))
    cache = torch.zeros(pages, block, hkv, d, dtype=dtype)
    tree_kv = torch.zeros(1, m, hkv, d, dtype=dtype)
    args = (torch.zeros(1, m, h, d, dtype=dtype), tree_kv, tree_kv, mask, torch.tensor([m]))
    paged = (cache, cache, torch.arange(pages).view(1, pages), torch.tensor([pages * block]))
    with aot.capture(module, "_tree_attention_kernel") as launches:
        module.tree_attention(*args, *paged, **tiles)
    return launches[0]


def gather_launch(shape: tuple[int, ...], dtype: torch.dtype):
    from benchmarks import triton_aot as aot
    from vllm_moa.kernels import paged_layer_kv as module

    layers, hkv, d = shape
    caches = [torch.zeros(4, hkv, 16, 2 * d, dtype=dtype) for _ in range(layers)]  # vLLM's layout
    with aot.capture(module, "_paged_layer_kv_kernel") as launches:
        module.paged_layer_kv(
            [c[..., :d] for c in caches], [c[..., d:] for c in caches], torch.arange(8)
        )
    return launches[0]


def built(make: Callable[[], Any], arch: int, **labels: Any) -> dict[str, Any]:
    """One build as a row; a build that fails to compile is a row with its error."""
    from benchmarks import triton_aot as aot

    row: dict[str, Any] = dict(labels)
    start = time.perf_counter()
    try:
        row.update(aot.build(make(), arch).as_dict())
    except Exception as e:  # a finding, not the end of the run
        row.update(arch=f"sm_{arch}", error=f"{type(e).__name__}: {e}"[:500])
    row["compile_seconds"] = round(time.perf_counter() - start, 2)
    return row


def passes(row: dict[str, Any]) -> bool:
    """A default build: compiled, fits, no spills; attention in 16 bits on the tensor cores; the
    gather (a copy, bandwidth-bound) reading 16 bytes per load."""
    if "error" in row or not row["fits"] or row["local_bytes"]:
        return False
    if row["kernel"] == "_paged_layer_kv_kernel":
        return row["global_loads"].get("LDG.E.128", 0) > 0
    return row["dtype"] == "fp32" or bool(row["tensor_core_ops"])


def defaults(smoke: bool) -> list[dict[str, Any]]:
    dtypes = ("fp32", "bf16") if smoke else tuple(DTYPES)
    kernels: list[tuple[Callable[..., Any], dict[str, tuple[int, ...]]]] = [
        (layer_launch, LAYER_SHAPES),
        (tree_launch, TREE_SHAPES),
        (gather_launch, GATHER_SHAPES),
    ]
    rows = []
    for arch in ARCHS:
        for name in dtypes:
            for launch, shapes in kernels:
                for shape, dims in shapes.items():
                    if smoke and shape != "llama3-8b":
                        continue
                    make = partial(launch, dims, DTYPES[name])
                    rows.append(built(make, arch, shape=shape, dtype=name))
    for row in rows:
        row["passes"] = passes(row)
    return rows


def controls() -> list[dict[str, Any]]:
    """Builds the check must fail (else it checks nothing): the tree kernel's earlier 16-bit
    default, 64 x 64 tiles with 4 warps, which spills registers on Hopper at head size 128; the
    gather without its alignment hint (caches at addresses not a multiple of 16 bytes), which
    loads element by element."""
    tree = partial(tree_launch, TREE_SHAPES["llama3-8b"], torch.bfloat16, num_warps=4)

    def unaligned_gather():
        launch = gather_launch(GATHER_SHAPES["llama3-8b"], torch.bfloat16)
        return dataclasses.replace(launch, kwargs={**launch.kwargs, "ALIGNED": False})

    rows = [
        built(tree, 90, shape="llama3-8b", dtype="bf16", requested_warps=4),
        built(unaligned_gather, 90, shape="llama3-8b", dtype="bf16", aligned=False),
    ]
    for row in rows:
        row["passes"] = passes(row)
    return rows


def sweep() -> dict[str, list[dict[str, Any]]]:
    from benchmarks.kernels_gpu import LAYER_TILES, TREE_TILES

    bf16 = torch.bfloat16
    return {
        "layer_attention": [
            built(
                partial(layer_launch, LAYER_SHAPES["llama3-8b"], bf16, block_g=g, num_warps=w),
                90,
                block_g=g,
                requested_warps=w,
            )
            for g, w in LAYER_TILES
        ],
        "tree_attention": [
            built(
                partial(
                    tree_launch, TREE_SHAPES["llama3-8b"], bf16, block_m=m, block_n=n, num_warps=w
                ),
                90,
                block_m=m,
                block_n=n,
                requested_warps=w,
            )
            for m, n, w in TREE_TILES
        ],
    }


def _ptxas_version() -> str:
    import triton

    out = subprocess.run(
        [triton.knobs.nvidia.ptxas.path, "--version"], capture_output=True, text=True
    ).stdout
    return out.strip().splitlines()[-1] if out.strip() else "unknown"


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    default = ROOT / "benchmarks" / "results" / "kernels" / "kernels_aot.json"
    p.add_argument("--out", default=str(default), help=f"default: {default.relative_to(ROOT)}")
    p.add_argument("--smoke", action="store_true", help="Llama-3-8B shapes, fp32 and bf16 only")
    args = p.parse_args()
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        sys.exit(
            "TRITON_INTERPRET is set: the kernels would be interpreted, not compiled; unset it"
        )
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton's default, stated
    sys.path.insert(0, str(ROOT))
    import triton

    from benchmarks.kernels_gpu import import_kernels
    from benchmarks.testbed.report import git_sha

    import_kernels()

    start = time.perf_counter()
    rows = defaults(args.smoke)
    result: dict[str, Any] = {
        "benchmark": "kernels_aot",
        "git_sha": git_sha(),
        "machine": {"platform": platform.platform(), "python": platform.python_version()},
        "triton": triton.__version__,
        "ptxas": _ptxas_version(),
        "torch": torch.__version__,
        "defaults": rows,
        "controls": controls(),
        "tile_sweep": {} if args.smoke else sweep(),
    }
    result["ok"] = all(r["passes"] for r in rows) and not any(
        r["passes"] for r in result["controls"]
    )
    result["seconds"] = round(time.perf_counter() - start, 1)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    for r in rows:
        print(
            f"{r['kernel']:<26} {r['shape']:<12} {r['dtype']:<5} {r['arch']}  "
            + (
                f"ERROR {r['error']}"
                if "error" in r
                else f"regs {r['registers']:>3} spill {r['local_bytes']:>5} B  shared "
                f"{r['shared_bytes']:>6} B  tc {r['tensor_core_ops']}  loads {r['global_loads']}"
            )
            + ("" if r["passes"] else "  FAILS")
        )
    caught = sum(not r["passes"] for r in result["controls"])
    print(
        f"{len(rows)} default builds, {sum(r['passes'] for r in rows)} pass; controls caught: "
        f"{caught}/{len(result['controls'])}; wrote {args.out}"
    )
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
