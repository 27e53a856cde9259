"""Step 6 (when time is left): PROJECTIONS, not measurements, of MoA's speedup at Llama-3-8B
cost with the taus of the CPU testbed (benchmarks/results/testbed/testbed_cpu_slim.json: a 4-layer
target and 1M-parameter drafters, so they say what those taus would buy at 8B cost, not what an
8B drafter achieves), for MoA TLI 0:

- `from_c`: a cycle costs steps x c + v + m decode steps, speedup = tau / that, with c from step
  3a (the draft step over the target step: graph-replayed Triton pages where captured, else
  eager; chains at batch 1, trees at batch 8 as a breadth-8 expansion drafts 8 rows a step,
  both over the batch-1 target step), v = a verify pass over a decode step (the cost model's
  eager measurement below, or 1, a memory-bound verify reading what a decode step reads, until
  it has run) and m = the page rows of one verified token (step 3a) over the target step;
- `cost_model`: benchmarks/cost_model.py's own (every drafter's eager batch-1 proposal and the
  verify passes through the standalone engine, context 512; its memory-bound bound too).
"""

from __future__ import annotations

from typing import Any

from benchmarks.cost_model import LLAMA3_8B, TREE, load_taus, measure, project
from benchmarks.gpu_check.common import ROOT, StepContext

TAUS = ROOT / "benchmarks" / "results" / "testbed" / "testbed_cpu_slim.json"
MIN_MEASURE_S = 60  # the cost model builds an 8B target and six drafters before timing


def costs(rows: list[dict[str, Any]], context: int) -> dict[str, Any] | None:
    """c for chains and trees and m at `context`, from step 3a's rows."""
    at = {r["batch"]: r for r in rows if r["context"] == context}
    if not at:
        return None
    one, wide = at[min(at)], at[min(at, key=lambda b: abs(b - TREE[1]))]
    needs = ("triton_graph_ms", "target_step_graph_ms")
    mode = "graph" if all(k in one and k in wide for k in needs) else "eager"
    target = one.get(f"target_step_{mode}_ms")
    if target is None:
        return None
    return {
        "context": context,
        "timing": mode,
        "c_chain": one[f"triton_{mode}_ms"] / target,
        "c_tree": wide[f"triton_{mode}_ms"] / target,
        "tree_batch": wide["batch"],
    }


def from_c(c: dict[str, Any], taus: dict[str, float], verify: dict[str, float], m: float) -> list:
    rows = []
    for mode, tau in taus.items():
        chain = mode.startswith("k")
        steps = int(mode[1:]) if chain else TREE[0]
        v = verify.get(mode if chain else "tree", 1.0)
        cycle = steps * (c["c_chain"] if chain else c["c_tree"]) + v + m
        rows.append({
            "mode": mode, "context": c["context"], "tau": tau, "verify_over_decode": v,
            "memory_rows_over_decode": m, "cycle_over_decode": cycle, "break_even_tau": cycle,
            "projected_speedup": tau / cycle,
            "verify_source": "cost model (eager)" if verify else "assumed 1 (memory-bound)",
        })  # fmt: skip
    return rows


def run(ctx: StepContext) -> None:
    part = ctx.part
    step3 = ctx.earlier("3a_draft_step")
    taus = load_taus(TAUS).get("moa_tli0", {})
    part.figures["label"] = "PROJECTION, not a measurement (see benchmarks/gpu_check/projection.py)"
    part.figures["tau_source"] = str(TAUS.relative_to(ROOT))
    contexts = sorted({r["context"] for r in step3.get("rows", [])})
    c_rows = [c for c in (costs(step3.get("rows", []), n) for n in contexts) if c]
    rows1 = [r for r in step3.get("page_rows", []) if r["rows"] == 1]
    if not part.check("step_3a_figures", bool(c_rows) and bool(rows1)):
        return
    part.figures["c"] = c_rows

    def project_c(verify: dict[str, float]) -> list:
        out = []
        for c in c_rows:
            one = next(r for r in step3["rows"] if r["context"] == c["context"])
            m = rows1[0]["kernel_ms"] / one[f"target_step_{c['timing']}_ms"]
            out += from_c(c, taus, verify, m)
        return out

    part.figures["from_c"] = project_c({})
    part.save()
    if ctx.cpu:  # 5-50 s on two busy cores: tests/test_cost_model.py runs its smoke mode
        part.notes.append("CPU mode: the cost model not run (tests/test_cost_model.py runs it)")
        return
    if ctx.seconds_left() < MIN_MEASURE_S:
        part.notes.append(f"cost model not run: under {MIN_MEASURE_S} s left")
        return
    context = 512
    result = measure(LLAMA3_8B, ctx.device, ctx.dtype, context)
    ms = result["ms"]
    verify = {f"k{k}": ms[f"verify_k{k}"] / ms["decode"] for k in (4, 6)}
    verify["tree"] = ms["verify_tree"] / ms["decode"]
    part.figures["cost_model"] = {
        "context": context,
        "ms": ms,
        "copy_bandwidth_gb_s": result["copy_bandwidth_gb_s"],
        "projection": project(result, load_taus(TAUS)),
    }
    part.figures["from_c"] = project_c(verify)
