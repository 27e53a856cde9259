"""The standalone engine (`vllm-moa generate`): plain decoding vs speculation at a fixed K vs
adaptive speculation length (the default), in output tokens/s.

    python -m benchmarks.standalone_adaptive --target DIR --drafter DIR [DIR ...] \
        --prompts HumanEval.jsonl.gz \
        --out benchmarks/results/standalone/standalone_adaptive_cpu.json

One engine per drafter, one target for all. For each prompt (`--prompts`, `--num-prompts` of
them, `--rounds` passes) the three modes run back to back, greedy, `--max-tokens` new tokens,
so drift in machine speed hits all alike; reported per drafter and mode: the median tokens/s
over the generations, the ratio of medians to plain, tau, and (adaptive) how many cycles drafted
each length. The adaptive engine keeps what it learnt across prompts, as a served engine would.
Writes a JSON (config, git SHA, machine, figures) and a PNG beside it.
"""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path
from typing import Any

MODES = ("plain", "fixed", "adaptive")


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    import torch
    from transformers import AutoTokenizer

    from benchmarks.testbed.evaluate import read_prompts
    from vllm_moa.adaptive import ADAPTIVE_ENV
    from vllm_moa.checkpoint import load_drafter
    from vllm_moa.checkpoint.io import drafter_dir_of
    from vllm_moa.decoding import SpeculativeEngine
    from vllm_moa.factories.proposers import make_proposer
    from vllm_moa.hf_target import HFTarget

    os.environ[ADAPTIVE_ENV] = "1"  # the modes are chosen per call below
    torch.manual_seed(0)
    target = HFTarget.from_pretrained(args.target)
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    prompts = [
        tokenizer(p)["input_ids"] for p in read_prompts(Path(args.prompts), args.num_prompts)
    ]
    plain = SpeculativeEngine(target)
    rows = []
    for d in args.drafter:
        drafter = load_drafter(str(drafter_dir_of(d)), target=target.shape)
        engine = SpeculativeEngine(target, make_proposer(drafter, target))
        engine.generate(prompts[0], 8, num_speculative_tokens=args.k)  # warm-up
        tps: dict[str, list[float]] = {m: [] for m in MODES}
        drafted = {m: 0 for m in MODES}
        accepted = {m: 0 for m in MODES}
        cycles = [0] * (args.k + 1)
        for _ in range(args.rounds):
            for ids in prompts:
                for mode in MODES:
                    eng = plain if mode == "plain" else engine
                    r = eng.generate(
                        ids, args.max_tokens, num_speculative_tokens=args.k,
                        adaptive=mode == "adaptive",
                    )  # fmt: skip
                    s = r.stats
                    tps[mode].append(s.num_generated_tokens / s.wall_time_s)
                    drafted[mode] += sum(s.draft_length_histogram[1:])
                    accepted[mode] += s.num_accepted_tokens
                    if mode == "adaptive":
                        cycles = [
                            a + b for a, b in zip(cycles, s.draft_length_histogram, strict=True)
                        ]
        base = statistics.median(tps["plain"])
        for mode in MODES:
            row: dict[str, Any] = {
                "drafter": d,
                "mode": mode,
                "tokens_per_s": statistics.median(tps[mode]),
                "tokens_per_s_all": tps[mode],
                "vs_plain": statistics.median(tps[mode]) / base,
            }
            if drafted[mode]:
                row["tau"] = 1 + accepted[mode] / drafted[mode]
            if mode == "adaptive":
                row["cycles_by_draft_length"] = cycles
                row["costs"] = engine.adaptive_lengths[args.k].summary()
            rows.append(row)
            print({k: v for k, v in row.items() if k != "tokens_per_s_all"}, flush=True)
    return rows


def _plot(path: Path, rows: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drafters = list(dict.fromkeys(r["drafter"] for r in rows))
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(MODES)
    for j, mode in enumerate(MODES):
        values = [next(r["vs_plain"] for r in rows if r["drafter"] == d and r["mode"] == mode)
                  for d in drafters]  # fmt: skip
        ax.bar([i + j * width for i in range(len(drafters))], values, width, label=mode)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks([i + width for i in range(len(drafters))], [Path(d).name for d in drafters])
    ax.set_ylabel("tokens/s vs plain decoding")
    ax.set_title("standalone engine: fixed K vs adaptive length")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    from benchmarks.testbed.report import add_out_argument, save_json

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", required=True)
    p.add_argument("--drafter", nargs="+", required=True, help="one engine each")
    p.add_argument("--prompts", required=True, help="e.g. ../shared/data/HumanEval.jsonl.gz")
    add_out_argument(p, "standalone_adaptive")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=64)
    args = p.parse_args()
    rows = run(args)
    out = Path(args.out)
    save_json(out, "standalone_adaptive", {"config": vars(args), "results": rows})
    _plot(out.with_suffix(".png"), rows)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
