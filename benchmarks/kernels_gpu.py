"""Kernel correctness and timing on a CUDA GPU at Llama-3-8B shapes (one run, one JSON).

    python benchmarks/kernels_gpu.py --out benchmarks/results/kernels/kernels_h200.json

Checks each Triton kernel against its PyTorch reference in bf16 (tolerance: 2x PyTorch's own
bf16 error against an fp32 reference), then times with triton.testing.do_bench (median), the
attention kernels also at neighbouring tile sizes (`tile_sweep`: the defaults were chosen from
the compiler's resource report, benchmarks/kernels_aot.py, never timed):
- layer attention (LSA, L=32, 32 heads / 8 KV heads of 64 over 2*E_kv=2048) vs the reference
  and vs torch SDPA, for 1024 and 4096 tokens;
- tree attention (m=62 nodes, 8 KV heads of 128, 32 query heads, paged prefix of 1024) vs the
  same number of tokens under a plain causal SDPA (the "<= 1.2x unmasked" target);
- the paged LSA gather (every layer's K|V of N scattered slots from 32 per-layer caches in
  vLLM's [blocks, 8, 16, 256] layout) vs the PyTorch gather and vs a device-to-device copy of
  the same bytes, alone and followed by the layer attention (the ">= 60% of copy bandwidth for
  >= 1024 tokens" target), for 1024 and 4096 tokens.
`--smoke` runs tiny shapes on the CPU (Triton interpreter) to check the script itself; `--quick`
skips the tile sweeps (the defaults only: what benchmarks/gpu_check runs).
Runs from a plain checkout too (no install: the repository's kernels/ is mapped as
vllm_moa.kernels, as pyproject does).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from functools import partial
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]


def import_kernels() -> None:
    """`vllm_moa.kernels`: from an install, else (vllm_moa maps it) this checkout's kernels/."""
    sys.path.insert(0, str(ROOT))
    import vllm_moa.kernels  # noqa: F401


def _err(out: torch.Tensor, ref32: torch.Tensor) -> float:
    return float((out.float() - ref32).abs().max())


FP32_TOL = 1e-5  # tests/test_kernels.py's: O(1) outputs, online softmax reorders the sums


def _ok(row: dict) -> bool:
    """Kernel error vs the fp32 reference within twice the PyTorch reference's own error in the
    run's dtype (bf16 on the GPU), and never below FP32_TOL: in fp32 (--smoke) the reference's
    error is 0 and the kernel's ~1e-6, so a tighter floor fails at random."""
    return row["kernel_err"] <= max(2 * row["torch_err"], FP32_TOL)


# Tile sweeps (timing runs only): the defaults were chosen without timing (the spill-free tiles
# of benchmarks/kernels_aot.py), so the one GPU session also times the neighbours, each checked
# like the default. Layer attention: query heads per program x warps; tree attention: (rows of
# (node, head) pairs, keys per tile, warps).
LAYER_TILES = [(1, 4), (2, 4), (4, 4), (4, 8), (8, 8)]
TREE_TILES = [
    (64, 64, 8),  # the 16-bit default at head size 128 (benchmarks/kernels_aot.py: no spills)
    (64, 64, 4),  # the earlier default (spills on Hopper)
    (32, 64, 4),
    (16, 64, 4),
    (64, 32, 4),
    (64, 128, 8),
    (128, 64, 8),
]


def _sweep_point(run, ref32: torch.Tensor, torch_err: float, timing: bool, **tiles: int) -> dict:
    """One tile setting: its error (same rule as the default) and, timing, its median time.
    The sweep does not decide the run's exit status: a failed setting is a finding."""
    point: dict[str, Any] = dict(tiles)
    try:
        point["kernel_err"] = _err(run(), ref32)
        point["ok"] = _ok({"kernel_err": point["kernel_err"], "torch_err": torch_err})
        if timing:
            from triton.testing import do_bench

            point["kernel_ms"] = do_bench(run)
    except Exception as e:  # e.g. out of shared memory for a large tile: record, go on
        point["error"] = f"{type(e).__name__}: {e}"[:300]
    return point


def bench_layer_attention(
    n: int, dtype: torch.dtype, device: str, timing: bool, sweep: bool = True
) -> dict:
    from vllm_moa.kernels.layer_attention import layer_attention, layer_attention_ref

    q = torch.randn(n, 32, 32, 64, device=device, dtype=dtype)
    k, v = torch.randn(2, n, 8, 32, 64, device=device, dtype=dtype)
    ref32 = layer_attention_ref(q.float(), k.float(), v.float())
    row: dict[str, Any] = {
        "tokens": n,
        "kernel_err": _err(layer_attention(q, k, v), ref32),
        "torch_err": _err(layer_attention_ref(q, k, v), ref32),
    }
    row["ok"] = _ok(row)
    row["tile_sweep"] = [
        _sweep_point(
            partial(layer_attention, q, k, v, block_g=bg, num_warps=w),
            ref32,
            row["torch_err"],
            timing,
            block_g=bg,
            num_warps=w,
        )
        for bg, w in (LAYER_TILES if sweep else [])
    ]
    if timing:
        from triton.testing import do_bench

        kr, vr = k.repeat_interleave(4, 1), v.repeat_interleave(4, 1)
        row["kernel_ms"] = do_bench(lambda: layer_attention(q, k, v))
        row["reference_ms"] = do_bench(lambda: layer_attention_ref(q, k, v))
        row["sdpa_ms"] = do_bench(
            lambda: torch.nn.functional.scaled_dot_product_attention(q, kr, vr)
        )
        moved = (q.numel() * 2 + k.numel() * 2) * q.element_size()  # read q, k, v; write o
        row["kernel_GBps"] = moved / row["kernel_ms"] / 1e6
    return row


def bench_tree_attention(
    batch: int, prefix: int, dtype: torch.dtype, device: str, timing: bool, sweep: bool = True
) -> dict:
    from vllm_moa.kernels.tree_attention import tree_attention, tree_attention_ref

    m, h, hkv, d, bs = 62, 32, 8, 128, 16
    pages = -(-prefix // bs)
    q = torch.randn(batch, m, h, d, device=device, dtype=dtype)
    kt, vt = torch.randn(2, batch, m, hkv, d, device=device, dtype=dtype)
    mask = torch.tril(torch.ones(m, m, dtype=torch.bool, device=device)).expand(batch, m, m)
    kc, vc = torch.randn(2, batch * pages, bs, hkv, d, device=device, dtype=dtype)
    table = torch.arange(batch * pages, device=device).view(batch, pages)
    args = [
        q,
        kt,
        vt,
        mask.contiguous(),
        torch.full((batch,), m, device=device),
        kc,
        vc,
        table,
        torch.full((batch,), prefix, device=device),
    ]
    ref32 = tree_attention_ref(*[a.float() if a.is_floating_point() else a for a in args])
    row: dict[str, Any] = {
        "batch": batch,
        "prefix": prefix,
        "nodes": m,
        "kernel_err": _err(tree_attention(*args), ref32),
        "torch_err": _err(tree_attention_ref(*args), ref32),
    }
    row["ok"] = _ok(row)
    row["tile_sweep"] = [
        _sweep_point(
            partial(tree_attention, *args, block_m=bm, block_n=bn, num_warps=w),
            ref32,
            row["torch_err"],
            timing,
            block_m=bm,
            block_n=bn,
            num_warps=w,
        )
        for bm, bn, w in (TREE_TILES if sweep else [])
    ]
    if timing:
        from triton.testing import do_bench

        row["kernel_ms"] = do_bench(lambda: tree_attention(*args))
        keys = torch.randn(batch, h, prefix + m, d, device=device, dtype=dtype)
        qs = q.transpose(1, 2)
        row["unmasked_sdpa_ms"] = do_bench(
            lambda: torch.nn.functional.scaled_dot_product_attention(qs, keys, keys)
        )
        row["ratio_vs_unmasked"] = row["kernel_ms"] / row["unmasked_sdpa_ms"]
        # read q, the nodes' K/V and the prefix's K/V pages; write o
        moved = (2 * q.numel() + 2 * kt.numel() + 2 * batch * prefix * hkv * d) * q.element_size()
        row["kernel_GBps"] = moved / row["kernel_ms"] / 1e6
    return row


def bench_paged_layer_kv(n: int, dtype: torch.dtype, device: str, timing: bool) -> dict:
    from vllm_moa.kernels.layer_attention import layer_attention
    from vllm_moa.kernels.paged_layer_kv import paged_layer_kv, paged_layer_kv_ref

    layers, hkv, d, bs = (32, 8, 128, 16) if timing else (4, 2, 32, 16)
    num_blocks = 2 * (-(-n // bs)) + 8  # the tokens' slots spread over twice their blocks
    caches = [
        torch.randn(num_blocks, hkv, bs, 2 * d, device=device, dtype=dtype) for _ in range(layers)
    ]
    keys, values = [c[..., :d] for c in caches], [c[..., d:] for c in caches]
    slots = torch.randperm(num_blocks * bs, device=device)[:n]
    got = paged_layer_kv(keys, values, slots)
    row: dict[str, Any] = {"tokens": n, "layers": layers, "kv_heads": hkv, "head_dim": d}
    row["ok"] = bool(torch.equal(got, paged_layer_kv_ref(keys, values, slots)))
    if timing:
        from triton.testing import do_bench

        src, dst = torch.empty_like(got), torch.empty_like(got)
        moved = 2 * got.numel() * got.element_size()  # read once, write once
        row["kernel_ms"] = do_bench(lambda: paged_layer_kv(keys, values, slots))
        row["reference_ms"] = do_bench(lambda: paged_layer_kv_ref(keys, values, slots))
        row["copy_ms"] = do_bench(lambda: dst.copy_(src))
        row["kernel_GBps"] = moved / row["kernel_ms"] / 1e6
        row["copy_GBps"] = moved / row["copy_ms"] / 1e6
        row["fraction_of_copy"] = row["copy_ms"] / row["kernel_ms"]
        # gather + LSA's layer attention (32 heads of 64 over 2*E_kv = 2048; q, k, v stand in
        # for the projections between them), against copying all the bytes the two move
        q = torch.randn(n, 32, layers, 64, device=device, dtype=dtype)
        k, v = torch.randn(2, n, 8, layers, 64, device=device, dtype=dtype)
        attn_moved = (q.numel() * 2 + k.numel() * 2) * q.element_size()
        row["gather_attention_ms"] = do_bench(
            lambda: (paged_layer_kv(keys, values, slots), layer_attention(q, k, v))
        )
        elements = (moved + attn_moved) // 2 // got.element_size()
        big_src = torch.empty(elements, device=device, dtype=dtype)
        big_dst = torch.empty_like(big_src)
        row["gather_attention_copy_ms"] = do_bench(lambda: big_dst.copy_(big_src))
        row["gather_attention_fraction_of_copy"] = (
            row["gather_attention_copy_ms"] / row["gather_attention_ms"]
        )
    return row


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    default = ROOT / "benchmarks" / "results" / "kernels" / "kernels_gpu.json"
    p.add_argument("--out", default=str(default), help=f"default: {default.relative_to(ROOT)}")
    p.add_argument("--smoke", action="store_true", help="tiny CPU run (Triton interpreter)")
    p.add_argument("--quick", action="store_true", help="no tile sweeps: the default tiles only")
    args = p.parse_args()
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"
    elif not torch.cuda.is_available():
        sys.exit("no CUDA GPU: run with --smoke to check the script on CPU")
    import_kernels()  # also puts this checkout on sys.path
    from benchmarks.testbed.report import git_sha

    device = "cpu" if args.smoke else "cuda"
    dtype = torch.float32 if args.smoke else torch.bfloat16
    timing = not args.smoke
    sizes = [2] if args.smoke else [1024, 4096]
    result: dict[str, Any] = {
        "benchmark": "kernels",
        "device": torch.cuda.get_device_name(0) if timing else "cpu",
        "torch": torch.__version__,
        "git_sha": git_sha(),
        "dtype": str(dtype),
        "layer_attention": [
            bench_layer_attention(n, dtype, device, timing, not args.quick) for n in sizes
        ],
        "tree_attention": [
            bench_tree_attention(
                b, 64 if args.smoke else 1024, dtype, device, timing, not args.quick
            )
            for b in ([1] if args.smoke else [1, 8])
        ],
        "paged_layer_kv": [bench_paged_layer_kv(n, dtype, device, timing) for n in sizes],
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return (
        0
        if all(
            r["ok"]
            for k in ("layer_attention", "tree_attention", "paged_layer_kv")
            for r in result[k]
        )
        else 1
    )


if __name__ == "__main__":
    raise SystemExit(main())
