"""Step 2: the three Triton kernels on the card against their PyTorch references.

2a runs tests/test_kernels.py with pytest (compiled on CUDA: every shape of the suite, fp32 and
the 16-bit dtypes, fresh random inputs); 2b runs benchmarks/kernels_gpu.py's checks at
Llama-3-8B shapes without the tile sweeps: bf16 timed against the PyTorch path and as a
fraction of the card's data-sheet bandwidth, fp32 checked only."""

from __future__ import annotations

import subprocess
import sys
import xml.etree.ElementTree as ET
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from benchmarks.gpu_check.common import ROOT, StepContext
from benchmarks.gpu_check.plan import peak_bandwidth

# CPU mode: three interpreter-quick tests, to check the plumbing (CI runs the whole file).
CPU_TESTS = (
    "test_layer_attention_equals_the_lsa_block_attention or "
    "test_paged_layer_kv_reads_split_kv_layouts or test_tree_attention_mask_matters"
)


def _junit(path: Any) -> dict[str, Any]:
    suite = ET.parse(path).getroot()
    suite = suite if suite.tag == "testsuite" else suite[0]
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    failing = [
        f"{case.get('classname')}::{case.get('name')}"
        for case in suite.iter("testcase")
        if case.find("failure") is not None or case.find("error") is not None
    ]
    skipped = [
        case.get("name") for case in suite.iter("testcase") if case.find("skipped") is not None
    ]
    return {**counts, "failing": failing[:30], "skipped_tests": skipped[:30]}


def run_tests(ctx: StepContext) -> None:
    junit = ctx.part.path.with_name("kernel_tests.xml")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}"]
    cmd.append("tests/test_kernels.py")
    if ctx.cpu:
        cmd += ["-k", CPU_TESTS]
    ctx.part.figures["selection"] = CPU_TESTS if ctx.cpu else "tests/test_kernels.py, all"
    try:
        rc = subprocess.run(cmd, cwd=ROOT, timeout=max(1.0, ctx.seconds_left() - 10)).returncode
    except subprocess.TimeoutExpired:
        ctx.part.notes.append("pytest ran out of time: its progress is in the log")
        ctx.part.check("kernel_tests_pass", False)
        return
    ctx.part.figures["pytest_rc"] = rc
    if junit.is_file():
        ctx.part.figures.update(_junit(junit))
    figures = ctx.part.figures
    passed = figures.get("tests", 0) - figures.get("failures", 0) - figures.get("errors", 0)
    ctx.part.check("kernel_tests_pass", rc == 0 and passed - figures.get("skipped", 0) > 0)


def _add_fraction(row: dict[str, Any], peak: float | None) -> dict[str, Any]:
    if "kernel_GBps" in row:
        row["fraction_of_peak"] = row["kernel_GBps"] * 1e9 / peak if peak else "unknown"
    return row


def run_bench(ctx: StepContext) -> None:
    from benchmarks.kernels_gpu import (
        bench_layer_attention,
        bench_paged_layer_kv,
        bench_tree_attention,
    )

    part, device = ctx.part, ctx.device
    card = ctx.earlier("1_env").get("card") or ("cpu" if ctx.cpu else torch.cuda.get_device_name(0))
    peak = None if ctx.cpu else peak_bandwidth(card)
    part.figures["peak_bandwidth_TBps"] = peak / 1e12 if peak else "unknown"
    sizes, batches, prefix = ([2], [1], 64) if ctx.cpu else ([1024, 4096], [1, 8], 1024)
    # bf16 timed at 8B shapes on the card; fp32 checked (not timed) there; the CPU: fp32 only
    runs = [(torch.float32, False)] if ctx.cpu else [(torch.bfloat16, True), (torch.float32, False)]
    for dtype, timing in runs:
        name = str(dtype).removeprefix("torch.")
        cases: list[tuple[str, Callable[[], dict[str, Any]]]] = [
            *((f"layer_attention_{n}", partial(bench_layer_attention, n, dtype, device, timing,
                                              sweep=False)) for n in sizes),
            *((f"tree_attention_b{b}", partial(bench_tree_attention, b, prefix, dtype, device,
                                              timing, sweep=False)) for b in batches),
            *((f"paged_layer_kv_{n}", partial(bench_paged_layer_kv, n, dtype, device, timing))
              for n in sizes),
        ]  # fmt: skip
        if ctx.cpu:  # 62 nodes x 32 heads take 5 s interpreted
            cases = [c for c in cases if not c[0].startswith("tree")]
            part.notes.append("CPU mode: tree attention left to step 2a's tests")
        rows: dict[str, dict[str, Any]] = {}
        part.figures[name] = rows
        for case, bench in cases:
            row = bench()
            row.pop("tile_sweep", None)
            rows[case] = _add_fraction(row, peak)
            part.check(f"{case}_{name}", row["ok"])
            part.save()
