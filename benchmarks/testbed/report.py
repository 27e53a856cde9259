"""Results JSON (config, git SHA, machine, figures) and a PNG bar chart of tau."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.results_paths import folder, portable, shell_join

REPO = Path(__file__).resolve().parents[2]
RESULTS = ":(exclude)benchmarks/results"  # where runs write their figures


def git_sha(repo: Path = REPO) -> str:
    """HEAD of this checkout (whatever the working directory), with "+dirty" when tracked code
    differs from it (so a figure is never credited to a commit that did not make it; changes
    under benchmarks/results, where runs write, do not count), or "unknown"."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=repo, capture_output=True, text=True, check=True, timeout=10
        ).stdout.strip()

    try:
        sha = git("rev-parse", "HEAD")
        changed = git("status", "--porcelain", "--untracked-files=no", "--", ".", RESULTS)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{sha}+dirty" if changed else sha


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "processor": platform.processor(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def command() -> str | None:
    """The command line of this run, where it was started as `python -m benchmarks...`."""
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    if spec is None or not spec.name.startswith("benchmarks."):
        return None  # e.g. a test calling main(argv): sys.argv is not this run's
    return shell_join(["python", "-m", spec.name.removesuffix(".__main__"), *sys.argv[1:]])


def default_out(benchmark: str) -> Path:
    """Where a run writes when given no --out: its benchmark's folder, named after the device
    kind (`throughput_cpu.json`, `throughput_gpu.json`; rename it for the record)."""
    device = "gpu" if torch.cuda.is_available() else "cpu"  # no CUDA context is created
    return folder(benchmark) / f"{benchmark}_{device}.json"


def add_out_argument(
    p: argparse.ArgumentParser, benchmark: str, type: Callable[[str], Any] = str
) -> None:
    """`--out`, by default in the benchmark's results folder (`default_out`)."""
    default = default_out(benchmark)
    p.add_argument(
        "--out",
        type=type,
        default=str(default),
        help=f"results JSON (a PNG is written beside it); default: {default.relative_to(REPO)}",
    )


def save_json(path: Path, benchmark: str, report: dict[str, Any]) -> dict[str, Any]:
    """Write a benchmark's results JSON with its name, the git SHA, the date, the command and the
    machine added, every path in it relative to a named root (`benchmarks.results_paths`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    full = {
        "benchmark": benchmark,
        "git_sha": git_sha(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command(),
        "machine": machine(),
        **report,
    }
    full = portable(full)
    path.write_text(json.dumps(full, indent=2) + "\n")
    return full


def write_report(path: Path, report: dict[str, Any], ks: tuple[int, ...]) -> None:
    """Write the run's report JSON (adding machine facts) and the tau bar chart beside it."""
    full = save_json(path, "testbed", report)
    _plot(path.with_suffix(".png"), full["results"], ks)


def _plot(path: Path, figures: dict[str, Any], ks: tuple[int, ...]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in figures if n != "plain"]
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(ks)
    for j, k in enumerate(ks):
        taus = [figures[n][f"k{k}"]["tau"] for n in names]
        ax.bar([i + j * width for i in range(len(names))], taus, width, label=f"K={k}")
    ax.set_xticks([i + width * (len(ks) - 1) / 2 for i in range(len(names))], names)
    ax.set_ylabel("mean acceptance length tau")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
