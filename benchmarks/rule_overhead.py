"""Host cost of adaptive speculation's rule per engine step, against the batch size: what the
rule adds to every step on top of the model, with no model at all. One run, one JSON + PNG.

    python -m benchmarks.rule_overhead \
        --out benchmarks/results/rule_overhead/rule_overhead_cpu.json

Two arms, each driven by synthetic steps (a fake clock: a verify step of `--verify-ms` plus
`--verify-ms-per-token` per verified token, a draft step of `--draft-ms`; every request's drafts
accepted one by one with probability `--acceptance`, so the rule keeps drafting):
- `v2`: the V2 speculator's `DraftSteps` (record a step, fold in the verdicts of earlier ones,
  choose the batch's number of draft steps m): `begin` + `choose` + `end`, timed together.
- `v1`: the V1 proposer's per-request rule (`AdaptiveLengths.choose` with entry costs) plus
  what it learns each step (every request's tracker and the cost model), timed together.
Reported per batch size: the median host microseconds a step over `--steps` timed steps (after
`--warmup`), per request, and the m / mean drafts chosen. The rule is plain Python, O(batch * K)
a step: on a GPU server this runs on the host while the device works (V2 with async
scheduling), so it matters when it approaches the device's step time.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vllm_moa.adaptive import AdaptiveLengths, StepCosts
from vllm_moa.vllm_plugin.draft_steps import DraftSteps


class FakeClock:
    """`StepClock`'s interface on a time the driver advances: marks are instants, always done."""

    def __init__(self) -> None:
        self.now = 0.0

    def mark(self) -> float:
        return self.now

    def done(self, mark: Any) -> bool:
        return True

    def seconds(self, start: float, end: float) -> float:
        return end - start


def _rejected(rng: np.random.Generator, n: int, slots: int, acceptance: float) -> np.ndarray:
    """Rejected draft slots of `slots` per request (vLLM's `num_rejected`): drafts accepted one
    by one with probability `acceptance`."""
    accepted = np.minimum(rng.geometric(1.0 - acceptance, n) - 1, slots)
    return (slots - accepted).astype(np.int64)


def time_v2(batch: int, args: argparse.Namespace) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    steps = DraftSteps(args.k, torch.device("cpu"))
    clock = FakeClock()
    steps.clock = clock  # type: ignore[assignment]
    ids = [f"r{i}" for i in range(batch)]
    slots = args.k  # V2 verifies K draft slots a request, whatever is drafted
    verified = np.full(batch, slots, dtype=np.int64)
    times, chosen = [], []
    for i in range(args.warmup + args.steps):
        rejected = torch.from_numpy(_rejected(rng, batch, slots, args.acceptance))
        clock.now += (args.verify_ms + args.verify_ms_per_token * batch * (1 + slots)) / 1e3
        start = time.perf_counter()
        steps.begin(ids, verified, batch * (1 + slots), False, rejected)
        m = steps.choose(args.k)
        clock.now += m * args.draft_ms / 1e3
        steps.end()
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
            chosen.append(m)
    return _row("v2", batch, times, chosen)


def time_v1(batch: int, args: argparse.Namespace) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    lengths = AdaptiveLengths(args.k, StepCosts())
    trackers = [lengths.tracker() for _ in range(batch)]
    budgets, catch_up, remaining = [args.k] * batch, [0] * batch, [10**6] * batch
    ks = [args.k] * batch
    times, chosen = [], []
    for i in range(args.warmup + args.steps):
        tokens = batch + sum(ks)
        verify = (args.verify_ms + args.verify_ms_per_token * tokens) / 1e3
        draft = max(ks) * args.draft_ms / 1e3
        rejected = _rejected(rng, batch, args.k, args.acceptance)
        start = time.perf_counter()
        for tracker, drafted, r in zip(trackers, ks, rejected.tolist(), strict=True):
            tracker.observe(drafted, min(max(args.k - r, 0), drafted))
        lengths.costs.observe_verify(tokens, verify)
        if max(ks):
            lengths.costs.observe_draft(max(ks), draft, sum(ks))
        ks = lengths.choose(trackers, budgets, catch_up, remaining)
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
            chosen.append(sum(ks) / batch)
    return _row("v1", batch, times, chosen)


def _row(arm: str, batch: int, times: list[float], chosen: Sequence[float]) -> dict[str, Any]:
    us = 1e6 * statistics.median(times)
    return {
        "arm": arm,
        "batch": batch,
        "us_per_step": round(us, 1),
        "us_per_request": round(us / batch, 2),
        "drafts_chosen_mean": round(statistics.fmean(chosen), 2),
    }


def _plot(path: Path, rows: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for arm, label in (("v1", "V1: per-request lengths"), ("v2", "V2: the batch's draft steps")):
        mine = [r for r in rows if r["arm"] == arm]
        ax.plot([r["batch"] for r in mine], [r["us_per_step"] for r in mine], "o-", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("requests in the step")
    ax.set_ylabel("rule's host time a step (us, median)")
    ax.set_title("Adaptive speculation's rule, host cost a step")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    from benchmarks.testbed.report import add_out_argument, save_json

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_out_argument(p, "rule_overhead")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16, 64, 256, 512])
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--acceptance", type=float, default=0.7)
    p.add_argument("--verify-ms", type=float, default=20.0)
    p.add_argument("--verify-ms-per-token", type=float, default=0.01)
    p.add_argument("--draft-ms", type=float, default=1.0)
    args = p.parse_args(argv)
    rows = []
    for batch in args.batch_sizes:
        for timer in (time_v1, time_v2):
            rows.append(timer(batch, args))
            print(rows[-1])
    out = Path(args.out)
    save_json(out, "rule_overhead", {"config": vars(args), "results": rows})
    _plot(out.with_suffix(".png"), rows)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
