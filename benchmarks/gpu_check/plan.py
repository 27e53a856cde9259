"""The check's steps and the card facts the report needs (no torch import: the orchestrator's)."""

from __future__ import annotations

import re
from dataclasses import dataclass

DEADLINE_ENV = "GPU_CHECK_DEADLINE"  # time.time() at which a step's timeout kills it


@dataclass(frozen=True)
class Step:
    id: str  # the key in the results JSON, in run order
    title: str
    target: str  # "module:function" under benchmarks.gpu_check, called with a StepContext
    limit_s: int  # this step's own timeout on a CUDA card
    min_s: int  # skipped when less of the budget is left
    short: bool  # part of --short (steps 1-3)


STEPS = (
    Step("1_env", "environment and smoke test", "env:run", 60, 15, True),
    Step("2a_kernel_tests", "kernel tests compiled (pytest)", "kernels:run_tests", 150, 30, True),
    Step(
        "2b_kernel_bench", "kernels timed at Llama-3-8B shapes", "kernels:run_bench", 90, 30, True
    ),
    Step("3a_draft_step", "paged draft step vs a target layer", "drafting:run_step", 120, 30, True),
    Step("3b_draft_compile", "paged draft step compiled", "compiled:run", 120, 45, True),
    Step("4_engine", "standalone engine greedy and sampling", "engine:run", 90, 20, False),
    Step("5_training", "training step at Llama-3-8B shapes", "training:run", 150, 45, False),
    Step("6_projection", "cost model projection fed c", "projection:run", 240, 45, False),
)

# Peak memory bandwidth by card name (vendor data sheets), bytes per second; first match wins.
PEAK_BANDWIDTH = (
    ("H200", 4.8e12),
    ("H100 NVL", 3.9e12),
    ("H100 PCIe", 2.0e12),
    ("H100", 3.35e12),  # SXM5, which PyTorch names "NVIDIA H100 80GB HBM3"
    ("A100-SXM4-80GB", 2.039e12),
    ("A100-SXM4-40GB", 1.555e12),
)


def peak_bandwidth(card: str) -> float | None:
    """The card's data-sheet memory bandwidth (bytes/s), None for a card not in the table."""
    for name, bandwidth in PEAK_BANDWIDTH:
        if name.lower() in card.lower():
            return bandwidth
    return None


def card_slug(card: str) -> str:
    """A file-name part for the card: `h100` for "NVIDIA H100 80GB HBM3", `cpu` for the CPU."""
    words = card.lower().replace("nvidia", " ").replace("-", " ").split()
    for word in words:
        if re.fullmatch(r"[a-z]+\d+[a-z]*", word):
            return word
    return "_".join(re.sub(r"[^a-z0-9]+", " ", " ".join(words)).split()) or "unknown"
