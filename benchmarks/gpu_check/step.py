"""One step in its own process: `python -m benchmarks.gpu_check.step ID --part FILE --results
FILE [--cpu]`. Exit 0: every check held; 1: a check failed; 2: the step raised (traceback in
the log, the error in the part file)."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback
from pathlib import Path

from benchmarks.gpu_check.plan import DEADLINE_ENV, STEPS


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("step", choices=[s.id for s in STEPS])
    p.add_argument("--part", type=Path, required=True, help="this step's figures (JSON)")
    p.add_argument("--results", type=Path, required=True, help="the results JSON so far")
    p.add_argument("--cpu", action="store_true", help="tiny shapes on the CPU")
    args = p.parse_args(argv)
    step = next(s for s in STEPS if s.id == args.step)
    module, function = step.target.split(":")
    from benchmarks.gpu_check.common import Part, StepContext

    part = Part(args.part)
    deadline = float(os.environ.get(DEADLINE_ENV, "inf"))
    ctx = StepContext(cpu=args.cpu, part=part, results=args.results, deadline=deadline)
    try:
        getattr(importlib.import_module(f"benchmarks.gpu_check.{module}"), function)(ctx)
    except Exception as e:
        traceback.print_exc()
        part.figures["error"] = f"{type(e).__name__}: {e}"[:1000]
        part.save()
        return 2
    part.save()
    failed = [name for name, ok in part.checks.items() if not ok]
    if failed:
        print(f"{step.id}: failed checks: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
