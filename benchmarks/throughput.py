"""vLLM serving throughput: plain decoding vs MoA (and vLLM's own EAGLE) across batch sizes.

    python -m benchmarks.throughput --target DIR --drafter DIR --prompts HumanEval.jsonl.gz \
        [--eagle EAGLE_DIR [EAGLE3_DIR]] --out benchmarks/results/throughput/throughput.json

`--eagle` takes EAGLE and EAGLE-3 drafters from our pipeline (`vllm-moa train --method eagle` or
`eagle3`; exported to vLLM's format on the fly) or already exported ones, each served by vLLM's
built-in `eagle` or `eagle3` method on the same target (arms `eagle_k4`, `eagle3_k4`). One
in-process vLLM engine per method (plain, then MoA and EAGLE with each K), all alive at once. For
each batch size b, rounds of b requests submitted together (closed loop), greedy, `--max-tokens`
new tokens each (ignore_eos: every method generates the same tokens), the target compiled as
vLLM runs it by default (`--enforce-eager` for eager), rounds alternating between the engines so
drift in machine speed hits all alike. Reported per (method, b): median output tokens/s over
rounds, request latency p50/p99, and acceptance (tau = 1 + accepted / drafts, per-position
rates) from vLLM's own spec-decode counters (process-wide, so read around each round of each
engine); speedup = ratio of medians; each MoA arm's per-round ratios to the other arms
(`paired`: median and a 90% interval of it). MoA runs twice by default (`--adaptive both`): with the
speculation length chosen per step (`moa_k4_adaptive`, the default a user gets) and with the
fixed K (`moa_k4`, VLLM_MOA_ADAPTIVE=0).
Writes a JSON (config, git SHA, machine, figures) and a PNG beside it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any
from unittest import mock

from vllm_moa.adaptive import ADAPTIVE_ENV
from vllm_moa.vllm_plugin.compiled import COMPILE_ENV

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


@dataclass
class SpecCounts:
    """Spec-decode counts of one engine since it started."""

    drafts: int = 0
    accepted: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def add(self, drafts: int, accepted: int, per_pos: list[int]) -> None:
        self.drafts += drafts
        self.accepted += accepted
        if not self.accepted_per_pos:
            self.accepted_per_pos = [0] * len(per_pos)
        self.accepted_per_pos = [a + b for a, b in zip(self.accepted_per_pos, per_pos, strict=True)]

    def since(self, before: SpecCounts) -> SpecCounts:
        per = before.accepted_per_pos or [0] * len(self.accepted_per_pos)
        return SpecCounts(
            self.drafts - before.drafts,
            self.accepted - before.accepted,
            [a - b for a, b in zip(self.accepted_per_pos, per, strict=True)],
        )


def make_engine(
    target: str,
    spec: dict[str, Any] | None,
    max_batch: int,
    dtype: str,
    eager: bool = False,
    **engine_args: Any,
) -> tuple[Any, SpecCounts]:
    """An in-process engine, and its spec-decode counts read through vLLM's custom stat-logger
    interface (`stat_loggers=`): vLLM's Prometheus counters cannot tell engines apart (each new
    engine in the process unregisters the previous engines' collectors)."""
    from vllm import EngineArgs, LLMEngine
    from vllm.v1.metrics.loggers import StatLoggerBase

    counts = SpecCounts()

    class Recorder(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            pass

        def record(self, scheduler_stats: Any, *args: Any, **kwargs: Any) -> None:
            stats = getattr(scheduler_stats, "spec_decoding_stats", None)
            if stats is not None:
                per_pos = list(stats.num_accepted_tokens_per_pos)
                counts.add(stats.num_drafts, stats.num_accepted_tokens, per_pos)

        def log_engine_initialized(self) -> None:
            pass

    args = EngineArgs(
        model=target,
        dtype=dtype,  # type: ignore[arg-type]  # a str from --dtype's choices
        enforce_eager=eager,
        speculative_config=spec,
        disable_log_stats=False,
        seed=0,
        max_num_seqs=max_batch,
        **engine_args,
    )
    return LLMEngine.from_engine_args(args, stat_loggers=[Recorder]), counts


def run_round(
    engine: Any, prompts: list[str], params: Any, tag: str
) -> tuple[float, int, list[float]]:
    """Submit all prompts at once, step until done: (elapsed s, output tokens, latencies)."""
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
    engines: dict[str, tuple[Any, SpecCounts]],
    prompts: list[str],
    batch_sizes: list[int],
    rounds: int,
    max_tokens: int,
) -> list[dict[str, Any]]:
    """Each round runs every engine, in turn, forward in even rounds and backward in odd ones
    (plain, MoA, ..., MoA, plain), so that drift in machine speed hits every method alike;
    figures are medians over rounds."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for engine, _ in engines.values():  # warm-up
        run_round(engine, prompts[: batch_sizes[0]], params, "warmup")
    rows = []
    next_prompt = 0
    for b in batch_sizes:
        per: dict[str, dict[str, list[Any]]] = {
            m: {"tps": [], "lat": [], "tokens": []} for m in engines
        }
        before = {m: replace(counts) for m, (_, counts) in engines.items()}
        for r in range(rounds):
            batch = [prompts[(next_prompt + i) % len(prompts)] for i in range(b)]
            next_prompt += b
            order = list(engines.items())
            for m, (engine, _) in order[::-1] if r % 2 else order:
                elapsed, tokens, lat = run_round(engine, batch, params, f"{m}-b{b}-r{r}")
                per[m]["tps"].append(tokens / elapsed)
                per[m]["lat"].extend(lat)
                per[m]["tokens"].append(tokens)
        for m, (_, counts) in engines.items():
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
            spec = counts.since(before[m])
            if spec.drafts:
                row["num_drafts"] = spec.drafts
                row["num_accepted_tokens"] = spec.accepted
                row["tau"] = 1 + spec.accepted / spec.drafts
                row["acceptance_per_position"] = [a / spec.drafts for a in spec.accepted_per_pos]
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "output_tokens_per_s_rounds"}))
    return rows


def median_interval(values: list[float], coverage: float = 0.9) -> tuple[float, float]:
    """A distribution-free interval for the median of `values` (order statistics): the j-th
    lowest and highest values, with the largest j whose interval covers the median with
    probability >= `coverage` (Binomial(n, 1/2)); the extremes when n is too small."""
    n, ordered = len(values), sorted(values)
    j, tail = 0, 0.0  # tail: P(Binomial(n, 1/2) <= j - 1)
    while j < n // 2:
        nxt = tail + math.comb(n, j) / 2**n
        if 2 * nxt > 1 - coverage:
            break
        tail, j = nxt, j + 1
    j = max(j, 1)
    return ordered[j - 1], ordered[n - j]


def paired_ratios(rows: list[dict[str, Any]]) -> None:
    """Add to each MoA row, per batch size, its per-round ratios to every other speculative arm
    (`paired`: rounds run every engine in turn, so round r of each is a pair): their median and
    a 90% interval of that median (`median_interval`)."""
    for b in {r["batch_size"] for r in rows}:
        at = [r for r in rows if r["batch_size"] == b]
        others = [r for r in at if r["method"] != "plain" and not r["method"].startswith("moa")]
        for r in (r for r in at if r["method"].startswith("moa")):
            r["paired"] = {}
            for o in [*others, *(p for p in at if p["method"] == "plain")]:
                ratios = [
                    x / y
                    for x, y in zip(
                        r["output_tokens_per_s_rounds"],
                        o["output_tokens_per_s_rounds"],
                        strict=True,
                    )
                ]
                low, high = median_interval(ratios)
                r["paired"][o["method"]] = {
                    "median": statistics.median(ratios),
                    "interval_90": [low, high],
                    "rounds": ratios,
                }


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
    ax.set_title("vLLM throughput: plain vs speculative methods")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def vllm_eagle_dir(path: str, target: str) -> tuple[str, str]:
    """(vLLM's method, the directory it loads): an EAGLE or EAGLE-3 drafter of ours is exported
    to vLLM's format (in a temporary directory); an already exported one is used as it is (an
    EAGLE-3 export names its `draft_vocab_size`)."""
    from vllm_moa.checkpoint.vllm_eagle import export_vllm_eagle, vllm_method_of

    config = Path(path) / "config.json"
    data = json.loads(config.read_text()) if config.is_file() else {}
    if data.get("model_type") == "llama":
        return ("eagle3" if "draft_vocab_size" in data else "eagle"), path
    exported = export_vllm_eagle(path, target, tempfile.mkdtemp(prefix="vllm_eagle_"))
    return vllm_method_of(path), str(exported)


def main() -> None:
    from benchmarks.testbed.evaluate import read_prompts
    from benchmarks.testbed.report import add_out_argument, save_json

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", required=True)
    p.add_argument(
        "--drafter", required=True, nargs="+", help="MoA drafter(s); several: one engine each"
    )
    p.add_argument(
        "--eagle", nargs="+", default=None,
        help="EAGLE and/or EAGLE-3 drafters (ours or vLLM-format) to add, one engine each",
    )  # fmt: skip
    p.add_argument("--ngram", action="store_true", help="add vLLM's ngram (prompt lookup)")
    p.add_argument(
        "--enforce-eager", action="store_true", help="eager target (default: compiled, as served)"
    )
    p.add_argument("--prompts", required=True, help="e.g. ../shared/data/HumanEval.jsonl.gz")
    add_out_argument(p, "throughput")
    p.add_argument("--k", type=int, nargs="+", default=[4])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument(
        "--adaptive", default="both", choices=["both", "on", "off"],
        help="MoA with adaptive speculation length, with the fixed K, or both (one engine each)",
    )  # fmt: skip
    p.add_argument(
        "--eager-proposer", action="store_true",
        help="also each MoA arm with its proposer not compiled (VLLM_MOA_COMPILE=0)",
    )  # fmt: skip
    args = p.parse_args()

    import vllm

    prompts = read_prompts(Path(args.prompts), 64)
    top = max(args.batch_sizes)
    methods = {"moa": ("moa", args.drafter[0])}
    if len(args.drafter) > 1:  # label each MoA engine by its drafter directory's name
        names = [Path(d).name for d in args.drafter]
        labels = [n if n.startswith("moa") else f"moa_{n}" for n in names]
        methods = {label: ("moa", d) for label, d in zip(labels, args.drafter, strict=True)}
    for path in args.eagle or []:
        method, model = vllm_eagle_dir(path, args.target)
        methods[method] = (method, model)
    eager = args.enforce_eager
    engines = {"plain": make_engine(args.target, None, top, args.dtype, eager)}
    modes = {"both": [False, True], "on": [True], "off": [False]}[args.adaptive]
    for k in args.k:
        for label, (method, model) in methods.items():
            spec = {"method": method, "model": model, "num_speculative_tokens": k}
            for adaptive in modes if method == "moa" else [False]:
                name = f"{label}_k{k}" + ("_adaptive" if adaptive else "")
                os.environ[ADAPTIVE_ENV] = "1" if adaptive else "0"  # read when the engine starts
                engines[name] = make_engine(args.target, spec, top, args.dtype, eager)
                if method == "moa" and args.eager_proposer:
                    with mock.patch.dict(os.environ, {COMPILE_ENV: "0"}):
                        engines[f"{name}_eager_proposer"] = make_engine(
                            args.target, spec, top, args.dtype, eager
                        )
        if args.ngram:
            spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4}
            engines[f"ngram_k{k}"] = make_engine(args.target, spec, top, args.dtype, eager)
    rows = run(engines, prompts, args.batch_sizes, args.rounds, args.max_tokens)
    plain = {r["batch_size"]: r["output_tokens_per_s"] for r in rows if r["method"] == "plain"}
    for r in rows:
        r["speedup_vs_plain"] = r["output_tokens_per_s"] / plain[r["batch_size"]]
    paired_ratios(rows)
    out = Path(args.out)
    save_json(out, "throughput", {"config": vars(args), "vllm": vllm.__version__, "results": rows})
    _plot(out.with_suffix(".png"), rows)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
