"""A PNG of the training curves from metrics.jsonl."""

from __future__ import annotations

import json
from pathlib import Path


def plot_metrics(metrics: Path, out: Path) -> Path | None:
    """Loss (and held-out proxy tau when present) against step; None if matplotlib is absent."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    if not rows:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    steps = [r["step"] for r in rows]
    axes[0].plot(steps, [r["loss"] for r in rows], label="loss")
    axes[0].plot(steps, [r["kl"] for r in rows], label="KL", alpha=0.7)
    axes[0].plot(steps, [r["feature"] for r in rows], label="feature", alpha=0.7)
    axes[0].set_xlabel("step")
    axes[0].set_yscale("log")
    axes[0].legend()
    evals = [r for r in rows if "eval_proxy_tau" in r]
    if evals:
        axes[1].plot([r["step"] for r in evals], [r["eval_proxy_tau"] for r in evals], "o-")
    axes[1].set_xlabel("step")
    axes[1].set_ylabel("held-out proxy tau")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
