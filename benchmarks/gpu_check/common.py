"""What every step gets: where it runs, its part of the results (saved as it goes), a timer."""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Part:
    """One step's figures, named checks (all must hold for status "ok") and notes, rewritten to
    `path` at every `save` so a step killed by its timeout still hands over what it measured."""

    path: Path
    figures: dict[str, Any] = field(default_factory=dict)
    checks: dict[str, bool] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def check(self, name: str, ok: bool) -> bool:
        self.checks[name] = bool(ok)
        return bool(ok)

    def save(self) -> None:
        data = {"figures": self.figures, "checks": self.checks, "notes": self.notes}
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1, default=str) + "\n")
        os.replace(tmp, self.path)


@dataclass(frozen=True)
class StepContext:
    cpu: bool  # tiny shapes on the CPU (Triton's interpreter); else a CUDA card at 8B shapes
    part: Part
    results: Path  # the results JSON so far (steps that use earlier figures read it)
    deadline: float = math.inf  # time.time() at which the step's timeout kills it

    def seconds_left(self) -> float:
        return self.deadline - time.time()

    @property
    def device(self) -> str:
        return "cpu" if self.cpu else "cuda"

    @property
    def dtype(self) -> torch.dtype:
        """bf16 on the card; fp32 on the CPU, where Triton's interpreter gets bf16 dots wrong
        (tests/test_kernels.py HALF_DTYPES)."""
        return torch.float32 if self.cpu else torch.bfloat16

    def earlier(self, step_id: str) -> dict[str, Any]:
        """An earlier step's figures ({} when it has none)."""
        if not self.results.is_file():
            return {}
        steps = json.loads(self.results.read_text()).get("steps", {})
        figures: dict[str, Any] = steps.get(step_id, {}).get("figures") or {}
        return figures


def timer(device: str) -> Callable[[Callable[[], object]], float]:
    """fn -> ms: on CUDA triton's do_bench median (benchmarks/cost_model.py's: L2 flushed
    between runs); on the CPU one wall-clock run after a warm-up (the CPU mode checks that the
    timing code runs; its interpreted kernels say nothing of speed)."""
    if device == "cuda":
        from benchmarks.cost_model import make_timer

        return make_timer(device)

    def once(fn: Callable[[], object]) -> float:
        fn()
        began = time.perf_counter()
        fn()
        return (time.perf_counter() - began) * 1e3

    return once


def guarded(part: Part, key: str, fn: Callable[[], Any]) -> Any:
    """fn(), or None with its error recorded under figures[key + "_error"]: one failing figure
    (a capture, a compile) does not cost the step's other figures."""
    try:
        return fn()
    except Exception as e:  # recorded, and the check that needed it fails
        part.figures[f"{key}_error"] = f"{type(e).__name__}: {e}"[:500]
        part.save()
        return None


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()
