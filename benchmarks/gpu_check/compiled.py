"""Step 3b: the paged draft step under torch.compile as the vLLM integration compiles it
(`vllm_plugin.compiled.Compiled`: Inductor, dynamic shapes, so batches from 2 share one graph
and batch 1 has its own), against the eager step, and the compiled step replayed from a CUDA
graph; with Triton pages (the kernel is `torch.compiler.disable`d: graphs split at attention)
and with PyTorch pages (one graph). Step 3a's sizes; each configuration's first call (the
compile) is timed apart. On the CPU: Dynamo with the `eager` backend (tracing only: Inductor's
C++ builds take minutes on two cores), no CUDA graph."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.gpu_check.common import StepContext, guarded, sync, timer
from benchmarks.gpu_check.drafting import Bench, build, graphed, relative_error
from vllm_moa.vllm_plugin.compiled import Compiled
from vllm_moa.vllm_plugin.drafting import paged_draft_step
from vllm_moa.vllm_plugin.paged_attention import TorchPagedKV, TritonPagedKV

Step = Callable[..., torch.Tensor]
MIN_LEFT_S = 30  # a configuration may recompile: start one only with this much time left


def compiled_step(cpu: bool) -> tuple[Step, Step]:
    """(the call that compiles, the call after it)."""
    if cpu:
        fn: Step = torch.compile(paged_draft_step, dynamic=True, backend="eager")
        return fn, fn
    compiled = Compiled(paged_draft_step)
    return compiled.warm, compiled


def one_config(
    ctx: StepContext, bench: Bench, stores: Any, steps: tuple[Step, Step], size: tuple[int, int]
) -> dict[str, Any]:
    part, time_ms = ctx.part, timer(ctx.device)
    batch, context = size
    x = bench.inputs(batch, context)
    row: dict[str, Any] = {"batch": batch, "context": context}
    eager = bench.step(stores, x, paged_draft_step)
    began = time.perf_counter()
    got = bench.step(stores, x, steps[0])
    sync(ctx.device)
    row["first_call_s"] = time.perf_counter() - began  # compile or recompile, if any
    row["relative_error"] = relative_error(got[0], eager[0])
    row["same_tokens"] = float((got[1] == eager[1]).float().mean())
    row["eager_ms"] = time_ms(lambda: bench.step(stores, x, paged_draft_step))
    row["compiled_ms"] = time_ms(lambda: bench.step(stores, x, steps[1]))
    if not ctx.cpu:
        key = f"graph_b{batch}_c{context}"
        captured = guarded(part, key, lambda: graphed(lambda: bench.step(stores, x, steps[1])))
        if captured is not None:
            graph, static = captured
            graph.replay()
            row["graph_equals_compiled"] = torch.equal(static[0], got[0])
            row["compiled_graph_ms"] = time_ms(graph.replay)
    return row


def run(ctx: StepContext) -> None:
    part = ctx.part
    bench = build(ctx)
    s = bench.sizes
    tol = 1e-4 if ctx.cpu else 3e-2  # bf16: Inductor fuses and reorders the sums
    part.figures["backend"] = "eager (Dynamo only)" if ctx.cpu else "inductor (Compiled)"
    part.figures["rows"] = []
    # batch 1 last: it compiles a graph of its own
    sizes = sorted(((b, c) for c in s.contexts for b in s.batches), key=lambda bc: bc[0] == 1)
    kinds: list[tuple[str, type[TorchPagedKV]]] = [
        ("triton", TritonPagedKV),
        ("torch", TorchPagedKV),
    ]
    if ctx.cpu:  # tracing alone takes 5-15 s a graph on two cores
        sizes, kinds = sizes[:1], kinds[:1]
        part.notes.append(
            "CPU mode: Dynamo's eager backend, Triton pages at one size (PyTorch pages: "
            "tests/test_paged_draft_compile.py); CUDA-graph capture skipped"
        )
    with torch.inference_mode():
        for name, kind in kinds:
            torch._dynamo.reset()
            steps = compiled_step(ctx.cpu)
            stores = bench.stores(kind)
            for size in sizes:
                if ctx.seconds_left() < MIN_LEFT_S:
                    part.notes.append(f"{name} {size}: not run, {MIN_LEFT_S} s needed")
                    continue
                row = {"pages": name, **one_config(ctx, bench, stores, steps, size)}
                part.figures["rows"].append(row)
                part.check(f"compiled_matches_eager_{name}_b{size[0]}_c{size[1]}",
                           row["relative_error"] <= tol)  # fmt: skip
                if "graph_equals_compiled" in row:
                    part.check(f"graph_equals_compiled_{name}_b{size[0]}_c{size[1]}",
                               row["graph_equals_compiled"])  # fmt: skip
                part.save()
