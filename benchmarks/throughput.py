"""vLLM serving throughput: plain decoding vs MoA speculative decoding, across batch sizes.

    python -m benchmarks.throughput --target DIR --drafter DIR --prompts HumanEval.jsonl.gz \
        --out benchmarks/results/throughput_cpu.json

For each method (plain, then MoA with each K) one in-process vLLM engine serves, for each batch
size b, rounds of b requests submitted together (closed loop: the next round starts when the
last request finishes), greedy, `--max-tokens` new tokens each (ignore_eos, so every method
generates the same number of tokens). Reported per (method, b): output tokens/s over the whole
run, request latency p50/p99, and acceptance (tau = 1 + accepted / drafts, per-position rates)
from vLLM's own spec-decode counters. Ratios to plain are computed within the same run.
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


def run_method(
    target: str,
    drafter: str | None,
    k: int,
    prompts: list[str],
    batch_sizes: list[int],
    rounds: int,
    max_tokens: int,
    dtype: str,
) -> list[dict[str, Any]]:
    from vllm import LLM, SamplingParams

    spec = None
    if drafter:
        spec = {"method": "moa", "model": drafter, "num_speculative_tokens": k}
    llm = LLM(
        model=target,
        dtype=dtype,
        enforce_eager=True,
        speculative_config=spec,
        disable_log_stats=False,
        seed=0,
        max_num_seqs=max(batch_sizes),
    )
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    engine = llm.llm_engine
    # Warm-up: one round at the smallest batch size (allocations, first-call overheads).
    llm.generate(prompts[: batch_sizes[0]], params, use_tqdm=False)
    results = []
    next_prompt = 0
    for b in batch_sizes:
        before = _spec_counters(llm)
        latencies: list[float] = []
        tokens = 0
        start = time.perf_counter()
        for r in range(rounds):
            submitted: dict[str, float] = {}
            for i in range(b):
                rid = f"b{b}-r{r}-{i}"
                engine.add_request(rid, prompts[next_prompt % len(prompts)], params)
                next_prompt += 1
                submitted[rid] = time.perf_counter()
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        latencies.append(time.perf_counter() - submitted[out.request_id])
                        tokens += len(out.outputs[0].token_ids)
        elapsed = time.perf_counter() - start
        after = _spec_counters(llm)
        row: dict[str, Any] = {
            "method": f"moa_k{k}" if drafter else "plain",
            "batch_size": b,
            "requests": b * rounds,
            "output_tokens": tokens,
            "elapsed_s": elapsed,
            "output_tokens_per_s": tokens / elapsed,
            "latency_p50_s": statistics.median(latencies),
            "latency_p99_s": _percentile(latencies, 0.99),
        }
        if drafter:
            drafts = after["vllm:spec_decode_num_drafts"] - before.get(
                "vllm:spec_decode_num_drafts", 0
            )
            accepted = after["vllm:spec_decode_num_accepted_tokens"] - before.get(
                "vllm:spec_decode_num_accepted_tokens", 0
            )
            per_pos_after = after["vllm:spec_decode_num_accepted_tokens_per_pos"]
            per_pos_before = before.get(
                "vllm:spec_decode_num_accepted_tokens_per_pos", [0] * len(per_pos_after)
            )
            row["num_drafts"] = drafts
            row["num_accepted_tokens"] = accepted
            row["tau"] = 1 + accepted / drafts if drafts else None
            row["acceptance_per_position"] = [
                (a - p) / drafts if drafts else None
                for a, p in zip(per_pos_after, per_pos_before, strict=True)
            ]
        results.append(row)
        print(json.dumps(row), flush=True)
    del llm
    return results


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
    rows = run_method(
        args.target, None, 0, prompts, args.batch_sizes, args.rounds, args.max_tokens, args.dtype
    )
    for k in args.k:
        rows += run_method(
            args.target,
            args.drafter,
            k,
            prompts,
            args.batch_sizes,
            args.rounds,
            args.max_tokens,
            args.dtype,
        )
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
