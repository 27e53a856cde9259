"""vLLM serving throughput: plain decoding vs MoA speculative decoding, across batch sizes.

    python -m benchmarks.throughput --target DIR --drafter DIR --prompts HumanEval.jsonl.gz \
        --out benchmarks/results/throughput_cpu.json

One in-process vLLM engine per method (plain, MoA with each K), all alive at once. For each
batch size b, rounds of b requests submitted together (closed loop), greedy, `--max-tokens` new
tokens each (ignore_eos: every method generates the same tokens), rounds alternating between
the engines so drift in machine speed hits all alike. Reported per (method, b): median output
tokens/s over rounds, request latency p50/p99, and acceptance (tau = 1 + accepted / drafts,
per-position rates) from vLLM's own spec-decode counters; speedup = ratio of medians.
Writes a JSON (config, git SHA, machine, figures) and a PNG beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")


def _spec_counters(llm: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:spec_decode"):
            out[m.name] = getattr(m, "values", None) or getattr(m, "value", 0)
    return out


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


def make_engine(target: str, drafter: str | None, k: int, max_batch: int, dtype: str) -> Any:
    from vllm import LLM

    spec = None
    if drafter:
        spec = {"method": "moa", "model": drafter, "num_speculative_tokens": k}
    return LLM(
        model=target,
        dtype=dtype,
        enforce_eager=True,
        speculative_config=spec,
        disable_log_stats=False,
        seed=0,
        max_num_seqs=max_batch,
    )


def run_round(
    llm: Any, prompts: list[str], params: Any, tag: str
) -> tuple[float, int, list[float]]:
    """Submit all prompts at once, step until done: (elapsed s, output tokens, latencies)."""
    engine = llm.llm_engine
    submitted: dict[str, float] = {}
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        rid = f"{tag}-{i}"
        engine.add_request(rid, prompt, params)
        submitted[rid] = time.perf_counter()
    latencies: list[float] = []
    tokens = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                latencies.append(time.perf_counter() - submitted[out.request_id])
                tokens += len(out.outputs[0].token_ids)
    return time.perf_counter() - start, tokens, latencies


def run(
    engines: dict[str, Any],
    prompts: list[str],
    batch_sizes: list[int],
    rounds: int,
    max_tokens: int,
) -> list[dict[str, Any]]:
    """Rounds alternate between the engines (plain, MoA, plain, ...) so that drift in machine
    speed hits every method alike; figures are medians over rounds."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for llm in engines.values():  # warm-up
        run_round(llm, prompts[: batch_sizes[0]], params, "warmup")
    rows = []
    next_prompt = 0
    for b in batch_sizes:
        per: dict[str, dict[str, list[Any]]] = {
            m: {"tps": [], "lat": [], "tokens": []} for m in engines
        }
        before = {m: _spec_counters(llm) for m, llm in engines.items()}
        for r in range(rounds):
            batch = [prompts[(next_prompt + i) % len(prompts)] for i in range(b)]
            next_prompt += b
            for m, llm in engines.items():
                elapsed, tokens, lat = run_round(llm, batch, params, f"{m}-b{b}-r{r}")
                per[m]["tps"].append(tokens / elapsed)
                per[m]["lat"].extend(lat)
                per[m]["tokens"].append(tokens)
        for m, llm in engines.items():
            row: dict[str, Any] = {
                "method": m,
                "batch_size": b,
                "rounds": rounds,
                "requests": b * rounds,
                "output_tokens": sum(per[m]["tokens"]),
                "output_tokens_per_s": statistics.median(per[m]["tps"]),
                "output_tokens_per_s_rounds": per[m]["tps"],
                "latency_p50_s": statistics.median(per[m]["lat"]),
                "latency_p99_s": _percentile(per[m]["lat"], 0.99),
            }
            after = _spec_counters(llm)
            # vLLM's counters live in a process-wide registry: only MoA engines draft.
            if m != "plain" and "vllm:spec_decode_num_drafts" in after:
                key = "vllm:spec_decode_num_drafts"
                drafts = after[key] - before[m].get(key, 0)
                key = "vllm:spec_decode_num_accepted_tokens"
                accepted = after[key] - before[m].get(key, 0)
                key = "vllm:spec_decode_num_accepted_tokens_per_pos"
                pos_before = before[m].get(key, [0] * len(after[key]))
                row["num_drafts"] = drafts
                row["num_accepted_tokens"] = accepted
                row["tau"] = 1 + accepted / drafts if drafts else None
                row["acceptance_per_position"] = [
                    (a - p) / drafts if drafts else None
                    for a, p in zip(after[key], pos_before, strict=True)
                ]
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "output_tokens_per_s_rounds"}))
    return rows


def _plot(path: Path, rows: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for method in dict.fromkeys(r["method"] for r in rows):
        mine = [r for r in rows if r["method"] == method]
        ax.plot(
            [r["batch_size"] for r in mine],
            [r["output_tokens_per_s"] for r in mine],
            marker="o",
            label=method,
        )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent requests (batch size)")
    ax.set_ylabel("output tokens/s")
    ax.set_title("vLLM throughput: plain vs MoA")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    from benchmarks.testbed.evaluate import read_prompts
    from benchmarks.testbed.report import git_sha, machine

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", required=True)
    p.add_argument("--drafter", required=True)
    p.add_argument("--prompts", required=True, help="e.g. ../shared/data/HumanEval.jsonl.gz")
    p.add_argument("--out", required=True, help="results JSON (a PNG is written beside it)")
    p.add_argument("--k", type=int, nargs="+", default=[4])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--dtype", default="float32")
    args = p.parse_args()

    import vllm

    prompts = read_prompts(Path(args.prompts), 64)
    top = max(args.batch_sizes)
    engines = {"plain": make_engine(args.target, None, 0, top, args.dtype)}
    for k in args.k:
        engines[f"moa_k{k}"] = make_engine(args.target, args.drafter, k, top, args.dtype)
    rows = run(engines, prompts, args.batch_sizes, args.rounds, args.max_tokens)
    plain = {r["batch_size"]: r["output_tokens_per_s"] for r in rows if r["method"] == "plain"}
    for r in rows:
        r["speedup_vs_plain"] = r["output_tokens_per_s"] / plain[r["batch_size"]]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "benchmark": "throughput",
        "config": vars(args),
        "git_sha": git_sha(),
        "vllm": vllm.__version__,
        "machine": machine(),
        "results": rows,
    }
    out.write_text(json.dumps(report, indent=2) + "\n")
    _plot(out.with_suffix(".png"), rows)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
