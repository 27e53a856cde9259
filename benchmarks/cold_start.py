"""Adaptive speculation after a loaded start-up: fresh MoA servers whose start-up (compilation,
first calls) runs beside processes that load every core, against fixed K and plain decoding.

    python -m benchmarks.cold_start [--rounds 5] [--out benchmarks/results/cold_start/NAME.json]

The quick start's pair (`vllm_moa.demo.ensure_demo_models`). One plain server and one MoA server
at a fixed K (`"moa_adaptive": false`) are started on a quiet machine; then, `--rounds` times, a
fresh MoA server in the default adaptive mode is started while `--burners` busy processes run
(until it answers), and the burners stop before any request. Each server is measured against
the plain one as the quick start measures (examples/compare_servers.py: the 4 prompts, batch 1,
greedy, alternating rounds), so each adaptive round's speed-up is comparable with fixed K's.
The adaptive rule's last log line (its calibrated costs, explorations, re-calibrations) is kept
per round. A new user's quick start met the lockout this measures (0.95x plain, 5 drafts in 12
requests, where fixed K gave about 1.8x). Writes JSON + PNG (config, git SHA, machine); the
servers' logs go to a temporary folder, named in the JSON's config.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.serve_sweep import Server
from benchmarks.testbed.report import add_out_argument, save_json

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from compare_servers import compare

from vllm_moa.demo import PROMPTS, ensure_demo_models

RULE_LOG = "MoA adaptive speculation:"


def _burn() -> None:
    while True:
        pass


def _last_rule_line(log: Path) -> str | None:
    lines = [line for line in log.read_text(errors="replace").splitlines() if RULE_LOG in line]
    return lines[-1].split(RULE_LOG, 1)[1].strip() if lines else None


def measure(name: str, server: Server, plain: Server, args: argparse.Namespace) -> dict[str, Any]:
    result = compare(
        {"plain": plain.base, "moa": server.base}, list(PROMPTS), args.max_tokens, args.rounds_each
    )
    row = {
        "arm": name,
        "speedup": result["speedup"],
        "tokens_per_s": result["tokens_per_s"],
        "identical": result["identical"],
        "drafts": result["moa_drafts"],
        "draft_tokens": result["moa_draft_tokens"],
        "accepted_tokens": result["moa_accepted_tokens"],
        "tau": result["moa_tau"],
    }
    time.sleep(1)
    row["rule"] = _last_rule_line(server.log)
    print(f"{name}: {row['speedup']:.2f}x plain, tau {row['tau']}, drafts {row['drafts']}")
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5, help="fresh adaptive servers")
    p.add_argument("--rounds-each", type=int, default=3, help="compare_servers rounds per server")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--max-model-len", type=int, default=512, help="the demo pair's context")
    p.add_argument("--burners", type=int, default=os.cpu_count() or 2)
    add_out_argument(p, "cold_start", type=Path)
    args = p.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    target, drafter = (str(x) for x in ensure_demo_models())
    spec = {"method": "moa", "model": drafter, "num_speculative_tokens": args.k}
    logs = Path(tempfile.mkdtemp(prefix="cold_start-"))
    rows = []
    plain = Server(target, None, logs / "plain.log", args.max_model_len)
    try:
        fixed = Server(
            target, spec | {"moa_adaptive": False}, logs / "fixed.log", args.max_model_len
        )
        try:
            rows.append(measure("fixed", fixed, plain, args))
        finally:
            fixed.stop()
        for r in range(args.rounds):
            burners = [
                multiprocessing.Process(target=_burn, daemon=True) for _ in range(args.burners)
            ]
            for b in burners:
                b.start()
            began = time.time()
            try:
                server = Server(target, spec, logs / f"adaptive-{r}.log", args.max_model_len)
            finally:
                for b in burners:
                    b.terminate()
            startup = time.time() - began
            try:
                row = measure(f"adaptive-{r}", server, plain, args)
                row["startup_s"] = startup
                rows.append(row)
            finally:
                server.stop()
    finally:
        plain.stop()
    fixed_speedup = rows[0]["speedup"]
    adaptive = [r["speedup"] for r in rows[1:]]
    config = vars(args) | {"target": target, "drafter": drafter, "logs": str(logs)}
    report = {
        "config": config | {"prompts": list(PROMPTS)},
        "results": rows,
        "fixed_speedup": fixed_speedup,
        "adaptive_speedups": adaptive,
        # each fresh adaptive server's speed-up over fixed K's (the issue's >= 0.9 each)
        "adaptive_over_fixed": [a / fixed_speedup for a in adaptive],
    }
    full = save_json(args.out, "cold_start", report)
    _plot(full, args.out.with_suffix(".png"))
    worst = min(report["adaptive_over_fixed"]) if adaptive else float("nan")
    print(
        f"fixed K: {fixed_speedup:.2f}x plain; adaptive after a loaded start-up: "
        f"{', '.join(f'{a:.2f}x' for a in adaptive)} (worst {worst:.2f} of fixed K's); "
        f"wrote {args.out}"
    )


def _plot(record: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = record["results"]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    names = [r["arm"] for r in rows]
    ax.bar(range(len(rows)), [r["speedup"] for r in rows], color=["C1"] + ["C0"] * (len(rows) - 1))
    ax.axhline(1.0, color="k", lw=0.8)
    ax.axhline(0.9 * record["fixed_speedup"], color="C1", ls="--", lw=0.8, label="0.9x fixed K")
    ax.set_xticks(range(len(rows)), names, rotation=30, fontsize=8)
    ax.set_ylabel("speed-up over plain (batch 1)")
    ax.set_title("MoA after a start-up beside CPU burners (adaptive) vs fixed K", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
