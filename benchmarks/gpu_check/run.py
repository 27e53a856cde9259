"""The orchestrator: runs the steps one after the other, each in its own process under its own
`timeout`, and rewrites the results JSON after every step.

    python -m benchmarks.gpu_check [--short] [--cpu] [--out DIR] [--budget SECONDS]
                                   [--steps ID,ID]   (e.g. 4_engine: a rerun of one step)

Files: DIR/gpu_check_<card>.json and .log (DIR: --out, else $OUT, else
benchmarks/results/gpu_check; <card> from torch.cuda.get_device_name after step 1, `cpu` on the
CPU; `_short` appended for --short, `_steps` for --steps). A step gets min(its own limit, what is
left of --budget) and is skipped, with the reason, when less than its minimum is left. The git
SHA: $GPU_CHECK_SHA, else git, else the file .gpu_check_sha in the checkout (a device call's tree
has no .git), else "unknown".
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any

from benchmarks.gpu_check.plan import DEADLINE_ENV, STEPS, Step, card_slug, peak_bandwidth

ROOT = Path(__file__).resolve().parents[2]
STATUS = {0: "ok", 1: "failed", 2: "error", 124: "timeout", 137: "timeout"}


def git_sha() -> str:
    sha = os.environ.get("GPU_CHECK_SHA", "").strip()
    if sha:
        return sha
    from benchmarks.testbed.report import git_sha as from_git

    sha = from_git()
    stored = ROOT / ".gpu_check_sha"
    if sha == "unknown" and stored.is_file():
        return stored.read_text().strip() or "unknown"
    return sha


class Results:
    """The results JSON and the log beside it, named after the card once step 1 has found it."""

    def __init__(self, out: Path, stem: str, header: dict[str, Any]) -> None:
        self.out, self.stem = out, stem
        self.data: dict[str, Any] = header
        out.mkdir(parents=True, exist_ok=True)
        self.json = out / f"gpu_check{stem}.json"
        self.log_path = out / f"gpu_check{stem}.log"
        self.log: IO[str] = self.log_path.open("w")
        self.write()

    def name_after(self, card: str) -> None:
        slug = card_slug(card)
        json_path = self.out / f"gpu_check_{slug}{self.stem}.json"
        log_path = self.out / f"gpu_check_{slug}{self.stem}.log"
        os.replace(self.json, json_path)
        os.replace(self.log_path, log_path)  # the open handle follows the file
        self.json, self.log_path = json_path, log_path

    def write(self) -> None:
        tmp = self.json.with_name(f".{self.json.name}.tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str) + "\n")
        os.replace(tmp, self.json)

    def say(self, line: str) -> None:
        print(line, flush=True)
        self.log.write(line + "\n")
        self.log.flush()


def run_step(step: Step, limit: int, cpu: bool, part: Path, results: Results) -> tuple[int, float]:
    """The step's process under `timeout` (then a kill 10 s later); its output to the log."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env[DEADLINE_ENV] = str(time.time() + limit)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    if cpu:
        env["TRITON_INTERPRET"] = "1"  # before any kernel is defined (the steps import them)
        # tiny shapes gain nothing from threads, and a busy machine's cores make OpenMP's
        # spinning threads wait on each other (the engine step: 13 s alone, 90+ s beside a job)
        env.setdefault("OMP_NUM_THREADS", "1")
    cmd = [sys.executable, "-m", "benchmarks.gpu_check.step", step.id]
    cmd += ["--part", str(part), "--results", str(results.json)] + (["--cpu"] if cpu else [])
    began = time.perf_counter()
    wall: float | None = None
    if shutil.which("timeout"):
        cmd = ["timeout", "--kill-after=10", str(limit), *cmd]
    else:  # no coreutils timeout: Python's (a kill at the limit)
        wall = limit + 10
    try:
        rc = subprocess.run(
            cmd, cwd=ROOT, env=env, stdout=results.log, stderr=subprocess.STDOUT, timeout=wall
        ).returncode
    except subprocess.TimeoutExpired:
        rc = 124
    return rc, time.perf_counter() - began


def record(step: Step, rc: int, seconds: float, part: Path, limit: int) -> dict[str, Any]:
    entry: dict[str, Any] = {"title": step.title, "status": STATUS.get(rc, "error")}
    entry.update(seconds=round(seconds, 1), limit_s=limit, rc=rc)
    if part.is_file():
        entry.update(json.loads(part.read_text()))
    if entry["status"] == "timeout":
        entry.setdefault("notes", []).append(f"killed at its {limit} s limit: figures so far")
    return entry


def parse(argv: list[str] | None) -> tuple[argparse.Namespace, list[Step]]:
    """The arguments and the steps they select."""
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--short", action="store_true", help="steps 1-3 only (a rerun after a fix)")
    p.add_argument("--cpu", action="store_true", help="tiny shapes on the CPU (also without CUDA)")
    p.add_argument(
        "--out", type=Path, default=None, help="default: $OUT, else benchmarks/results/gpu_check"
    )
    p.add_argument("--budget", type=float, default=420.0, help="seconds for all steps together")
    p.add_argument(
        "--steps", default=None, help="only these step ids, comma-separated (1_env always runs)"
    )
    args = p.parse_args(argv)
    known = {s.id for s in STEPS}
    wanted = set(args.steps.split(",")) | {"1_env"} if args.steps else known
    if wanted - known:
        p.error(f"--steps {args.steps}: unknown {sorted(wanted - known)}; steps: {sorted(known)}")
    return args, [s for s in STEPS if (s.short or not args.short) and s.id in wanted]


def main(argv: list[str] | None = None) -> int:
    args, plan = parse(argv)
    import torch

    cpu = args.cpu or not torch.cuda.is_available()
    out = args.out or Path(os.environ.get("OUT") or ROOT / "benchmarks" / "results" / "gpu_check")
    header: dict[str, Any] = {
        "benchmark": "gpu_check",
        "mode": "cpu" if cpu else "cuda",
        "short": args.short,
        "git_sha": git_sha(),
        "budget_s": args.budget,
        "complete": False,
        "steps": {s.id: {"title": s.title, "status": "pending"} for s in plan},
    }
    if cpu:
        header["card"] = "cpu"
    stem = ("_cpu" if cpu else "") + ("_short" if args.short else "")
    results = Results(out, stem + ("_steps" if args.steps else ""), header)
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as work:
        run_plan(plan, results, Path(work), args.budget, cpu)
    results.data["complete"] = True
    results.write()
    statuses = {k: v["status"] for k, v in results.data["steps"].items()}
    results.say(f"results: {results.json}\n{json.dumps(statuses)}")
    results.log.close()
    return 0 if all(s == "ok" for s in statuses.values()) else 1


def run_plan(plan: list[Step], results: Results, work: Path, budget: float, cpu: bool) -> None:
    began = time.perf_counter()
    for step in plan:
        left = budget - (time.perf_counter() - began)
        if left < step.min_s:
            note = f"skipped: {left:.0f} s of the budget left, the step needs {step.min_s} s"
            results.data["steps"][step.id].update(status="skipped", notes=[note])
            results.write()
            results.say(f"== {step.id}: {note}")
            continue
        limit = int(min(step.limit_s, left))
        results.say(f"== {step.id}: {step.title} (limit {limit} s)")
        part, start = work / f"{step.id}.json", results.log.tell()
        rc, seconds = run_step(step, limit, cpu, part, results)
        entry = record(step, rc, seconds, part, limit)
        results.data["steps"][step.id] = entry
        if step.id == "1_env":
            _machine(results, entry.get("figures", {}), cpu)
        results.data["elapsed_s"] = round(time.perf_counter() - began, 1)
        results.write()
        if entry["status"] != "ok":  # the device tool's reply shows stdout's end: the why
            print(_tail(results.log_path, start), flush=True)
        failed = [name for name, ok in entry.get("checks", {}).items() if not ok]
        results.say(f"-- {step.id}: {entry['status']} in {seconds:.1f} s"
                    + (f"; failed checks: {', '.join(failed)}" if failed else ""))  # fmt: skip


def _tail(log: Path, start: int, lines: int = 20) -> str:
    """The last lines a step wrote to the log (from byte `start`)."""
    with log.open("rb") as f:
        f.seek(start)
        text = f.read().decode(errors="replace")
    return "\n".join(text.splitlines()[-lines:])


def _machine(results: Results, figures: dict[str, Any], cpu: bool) -> None:
    """Step 1's facts at the top of the results (`machine` as benchmarks/results_index.py
    reads it); on a card, the files take its name."""
    card, versions = figures.get("card"), figures.get("versions") or {}
    results.data["machine"] = {
        "gpu": card,
        "torch": versions.get("torch"),
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
    }
    results.data["versions"] = versions
    if cpu or not card:
        return
    bandwidth = peak_bandwidth(card)
    results.data["card"] = card
    results.data["peak_bandwidth_TBps"] = bandwidth / 1e12 if bandwidth else "unknown"
    results.name_after(card)
