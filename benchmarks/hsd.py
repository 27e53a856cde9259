"""Hierarchical speculative decoding on the standalone engine: the planner's stack against the
best single drafter and plain decoding, measured next to what the planner predicted.

    python -m benchmarks.hsd --target DIR --candidates ngram,EAGLE_DIR,MOA_DIR \
        --prompts ../shared/data/HumanEval.jsonl.gz --out benchmarks/results/hsd/hsd_gpu.json

First the planner's inputs are measured on `--measure-prompts` prompts (costs of each level's
draft step and scoring pass and of the target's pass; pairwise acceptance from decoding runs;
`--inputs FILE` reuses a file `vllm-moa hsd-plan --measure --out` wrote). The search then
gives the arms: plain decoding, the best single drafter (a one-level stack: chain drafting of T,
verified by the target), the best stack of two or more levels, and the overall best if it is
neither. Each arm decodes the next `--num-prompts` prompts (`--rounds` passes, arms back to back
per prompt so drift in machine speed hits all alike), greedy, `--max-tokens` new tokens.
Reported per arm: tokens/s (median over generations) and its ratio to plain, target calls per
token, each level's forward passes per token (prompt lookup: none) and alpha, the bottom's
drafted tokens per token, and the measured seconds per token (all wall time over all tokens)
beside the model's predictions (its passes per token count the bottom's drafted tokens).
Writes a JSON (config, git SHA, machine, planner inputs, figures) and a PNG beside it.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any


def _arms(plans: list[Any]) -> dict[str, Any]:
    """plain, the best single drafter, the best stack of >= 2 levels, and the best overall."""
    arms: dict[str, Any] = {"plain": next(p for p in plans if not p.levels)}
    singles = [p for p in plans if len(p.levels) == 1]
    stacks = [p for p in plans if len(p.levels) >= 2]
    if singles:
        arms["best single drafter"] = singles[0]
    if stacks:
        arms["best hierarchy"] = stacks[0]
    if plans[0] not in arms.values():
        arms["planner's choice"] = plans[0]
    return arms


def _generation(engine: Any, ids: list[int], max_tokens: int) -> dict[str, Any]:
    """One generation's totals: tokens, seconds, target calls; per level passes, alpha counts."""
    s = engine.generate(ids, max_tokens).stats
    levels = getattr(s, "levels", [])
    return {
        "tokens": s.num_generated_tokens,
        "wall_s": s.wall_time_s,
        "target_calls": s.num_target_calls,
        "passes": [level.forward_passes for level in levels],
        "drafted": sum(level.proposed for level in levels[:1]),
        "accepted": [level.accepted for level in levels],
        "tested": [level.accepted + level.rejections for level in levels],
    }


def _summary(gens: list[dict[str, Any]]) -> dict[str, Any]:
    """An arm's generations: tokens/s (median, and each), per-token means over all tokens."""
    tokens = sum(g["tokens"] for g in gens)

    def total(key: str) -> list[int]:
        return [sum(values) for values in zip(*(g[key] for g in gens), strict=True)]

    tps = [g["tokens"] / g["wall_s"] for g in gens]
    return {
        "tokens_per_s": statistics.median(tps),
        "tokens_per_s_all": tps,
        "measured_latency_s": sum(g["wall_s"] for g in gens) / tokens,
        "target_calls_per_token": sum(g["target_calls"] for g in gens) / tokens,
        "passes_per_token": [p / tokens for p in total("passes")],
        "bottom_drafts_per_token": sum(g["drafted"] for g in gens) / tokens,
        "alpha": [
            a / t if t else 0.0 for a, t in zip(total("accepted"), total("tested"), strict=True)
        ],
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from transformers import AutoTokenizer

    from benchmarks.testbed.evaluate import read_prompts
    from vllm_moa.decoding import SpeculativeEngine
    from vllm_moa.factories.proposers import level_proposer, parse_levels
    from vllm_moa.hf_target import HFTarget
    from vllm_moa.hsd.hierarchy import HierarchicalEngine, Level
    from vllm_moa.hsd.measure import MeasureConfig, measure_inputs
    from vllm_moa.hsd.plan import PlanInputs, best_plans

    torch.manual_seed(0)
    target = HFTarget.from_pretrained(args.target)
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    texts = read_prompts(Path(args.prompts), args.measure_prompts + args.num_prompts)
    prompts = [list(tokenizer(t)["input_ids"]) for t in texts]
    entries = parse_levels(args.candidates)
    candidates = {
        e: level_proposer(e, target, args.target, target.dtype, target.device) for e in entries
    }
    if args.inputs:
        inputs = PlanInputs.load(args.inputs)
    else:
        config = MeasureConfig(max_new_tokens=args.max_tokens)
        inputs = measure_inputs(target, candidates, prompts[: args.measure_prompts], config)
    inputs.notes["target"] = args.target
    plans = best_plans(inputs, args.max_buffer)
    arms = _arms(plans)
    engines: dict[str, Any] = {}
    for name, plan in arms.items():
        levels = [
            Level(e, candidates[e], t) for e, t in zip(plan.levels, plan.buffers, strict=True)
        ]
        engines[name] = HierarchicalEngine(target, levels) if levels else SpeculativeEngine(target)
        engines[name].generate(prompts[0], 8)  # warm-up
    evaluation = prompts[args.measure_prompts :]
    gens: dict[str, list[dict[str, Any]]] = {name: [] for name in arms}
    for _ in range(args.rounds):
        for ids in evaluation:
            for name, engine in engines.items():
                gens[name].append(_generation(engine, ids, args.max_tokens))
    rows = []
    base = _summary(gens["plain"])["tokens_per_s"]
    for name, plan in arms.items():
        row = _summary(gens[name])
        row.update(
            arm=name,
            levels=list(plan.levels),
            buffers=list(plan.buffers),
            vs_plain=row["tokens_per_s"] / base,
            predicted_latency_s=plan.latency_s,
            predicted_target_calls_per_token=plan.passes_per_token[-1],
            # the bottom's entry counts drafted tokens (prompt lookup's run no model)
            predicted_passes_per_token=list(plan.passes_per_token[:-1]),
        )
        rows.append(row)
        print({k: v for k, v in row.items() if k != "tokens_per_s_all"}, flush=True)
    return {"inputs": inputs.to_dict(), "plans": [p.to_dict() for p in plans[:10]], "results": rows}


def _plot(path: Path, rows: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    x = range(len(rows))
    labels = [r["arm"] for r in rows]
    left.bar(
        [i - 0.2 for i in x], [r["measured_latency_s"] * 1e3 for r in rows], 0.4, label="measured"
    )
    left.bar(
        [i + 0.2 for i in x], [r["predicted_latency_s"] * 1e3 for r in rows], 0.4, label="predicted"
    )
    left.set_xticks(list(x), labels, rotation=15)
    left.set_ylabel("ms per token")
    left.legend()
    right.bar(list(x), [r["target_calls_per_token"] for r in rows])
    right.set_xticks(list(x), labels, rotation=15)
    right.set_ylabel("target calls per token")
    fig.suptitle("hierarchical speculative decoding: planner's choice vs best single drafter")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    from benchmarks.testbed.report import add_out_argument, save_json
    from vllm_moa.cli.main import positive_int

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", required=True)
    p.add_argument("--candidates", required=True, help="LEVELS: ngram,DRAFTER_DIR,... bottom first")
    p.add_argument("--prompts", required=True, help="e.g. ../shared/data/HumanEval.jsonl.gz")
    add_out_argument(p, "hsd")
    p.add_argument("--inputs", default=None, help="planner inputs to reuse instead of measuring")
    p.add_argument("--measure-prompts", type=positive_int, default=4)
    p.add_argument("--num-prompts", type=positive_int, default=8, help="after the measured ones")
    p.add_argument("--rounds", type=positive_int, default=2)
    p.add_argument("--max-tokens", type=positive_int, default=64)
    p.add_argument("--max-buffer", type=positive_int, default=8)
    args = p.parse_args()
    report = run(args)
    out = Path(args.out)
    save_json(out, "hsd", {"config": vars(args), **report})
    _plot(out.with_suffix(".png"), report["results"])
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
