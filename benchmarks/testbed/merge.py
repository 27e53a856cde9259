"""Several testbed runs against one target (seeds, recipe options) in one results file:

    python -m benchmarks.testbed.merge --out benchmarks/results/testbed/testbed_cpu_recipe.json \
        RUN.json [RUN.json ...]

Each input is a `python -m benchmarks.testbed` results JSON; all must share the target (preset,
its training) and the evaluation (prompts, new tokens, K). The output is a testbed results JSON
whose `results` hold every run's drafters (by run name, e.g. `moa_tli0_slim_k3_8_s1`) and one
`plain`, whose `runs` keep each input's command, git SHA, date and drafter training, and whose
`spread` gives, per drafter recipe (the run name without its `_s<seed>`), each K's tau over the
seeds (mean, min, max): the comparison the recipe options need.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path
from typing import Any

from benchmarks.testbed.report import save_json

# What every merged run must share: the target and how drafters are evaluated.
SHARED = ("preset", "prompts", "skipped_prompts", "device", "target_training")
SHARED_CONFIG = ("vocab_size", "hidden_size", "num_layers", "num_kv_heads", "intermediate_size",
                 "target_steps", "corpus_bytes", "seed", "seq_len", "eval_prompts",
                 "eval_new_tokens", "ks", "drafter_steps")  # fmt: skip
SEED = re.compile(r"_s\d+$")


def merge(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One report from several (the first one's shared fields)."""
    if not runs:
        raise ValueError("give at least one testbed results JSON")
    first = runs[0]
    for i, run in enumerate(runs[1:], 1):
        for key in SHARED:
            if run.get(key) != first.get(key):
                raise ValueError(f"run {i} differs from run 0 in {key!r}: they cannot be merged")
        for key in SHARED_CONFIG:
            if run["config"].get(key) != first["config"].get(key):
                raise ValueError(f"run {i} differs from run 0 in config {key!r}")
    results: dict[str, Any] = {}
    for run in runs:
        for name, figures in run["results"].items():
            if name != "plain" and name in results:
                raise ValueError(f"{name} is in two runs: merge each drafter once")
            results.setdefault(name, figures)
    spread: dict[str, dict[str, Any]] = {}
    for name, figures in results.items():
        if name == "plain":
            continue
        recipe = spread.setdefault(SEED.sub("", name), {"runs": []})
        recipe["runs"].append(name)
        for k, f in figures.items():
            if isinstance(f, dict) and "tau" in f:
                recipe.setdefault(k, []).append(f["tau"])
    for recipe in spread.values():
        for k, taus in list(recipe.items()):
            if k != "runs":
                recipe[k] = {"mean": statistics.fmean(taus), "min": min(taus), "max": max(taus)}
    return {
        **{key: first.get(key) for key in SHARED},
        "config": {k: first["config"].get(k) for k in SHARED_CONFIG},
        "results": results,
        "spread": spread,
        "runs": [
            {k: run.get(k) for k in ("command", "git_sha", "date", "config", "drafter_training")}
            for run in runs
        ],
        "complete": all(run.get("complete") for run in runs),
    }


def plot(path: Path, spread: dict[str, dict[str, Any]]) -> None:
    """Bars of each recipe's mean tau per K, whiskers from the lowest to the highest seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(spread)
    ks = sorted({k for f in spread.values() for k in f if k != "runs"})
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(names)), 4))
    width = 0.8 / max(1, len(ks))
    for j, k in enumerate(ks):
        xs = [i + j * width for i in range(len(names))]
        mean = [spread[n][k]["mean"] if k in spread[n] else 0.0 for n in names]
        low = [
            m - spread[n][k]["min"] if k in spread[n] else 0.0
            for m, n in zip(mean, names, strict=True)
        ]
        high = [
            spread[n][k]["max"] - m if k in spread[n] else 0.0
            for m, n in zip(mean, names, strict=True)
        ]
        ax.bar(xs, mean, width, yerr=[low, high], capsize=3, label=k)
    ax.set_xticks([i + width * (len(ks) - 1) / 2 for i in range(len(names))], names, fontsize=7)
    ax.set_ylabel("tau (mean over seeds; whiskers: min-max)")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", type=Path, help="testbed results JSON files")
    p.add_argument("--out", required=True, type=Path)
    args = p.parse_args(argv)
    report = merge([json.loads(path.read_text()) for path in args.runs])
    save_json(args.out, "testbed", report)
    plot(args.out.with_suffix(".png"), report["spread"])
    for recipe, figures in report["spread"].items():
        taus = {k: round(v["mean"], 3) for k, v in figures.items() if k != "runs"}
        print(recipe, len(figures["runs"]), "runs", taus)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
