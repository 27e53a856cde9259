"""scripts/gpu_check.sh (benchmarks/gpu_check): the one-call GPU check, run here in its CPU mode
(tiny shapes, Triton's interpreter, no CUDA graphs) from a bare copy of the checkout as the
device runs it (nothing of the project installed, no vLLM); its plan, budget and card naming
without running the steps."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.gpu_check.plan import STEPS, Step, card_slug, peak_bandwidth
from benchmarks.gpu_check.run import record

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
SHORT = [s.id for s in STEPS if s.id[0] in "123"]


# What the device has: torch, triton, transformers, safetensors, pytest, but neither vLLM nor
# this project installed. A sitecustomize on PYTHONPATH drops this venv's editable-install finder
# and refuses vLLM imports, in the check and in every process it starts.
DEVICE_SITE = """import sys
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]


class _NoVllm:
    def find_spec(self, name, path=None, target=None):
        if name == "vllm" or name.startswith("vllm."):
            raise ModuleNotFoundError(f"No module named {name!r} (the device has no vLLM)")


sys.meta_path.insert(0, _NoVllm())
"""


def _bare_copy(dest: Path) -> Path:
    """The checkout's tracked files, as the device tool copies a working tree (no .git)."""
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()  # fmt: skip
    for name in files:
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, dest / name)
    site = dest.parent / "device_site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(DEVICE_SITE)
    return site


def _check(tmp_path: Path, *flags: str, bare: bool = False) -> tuple[int, dict]:
    env = dict(os.environ, PYTHON=sys.executable, GPU_CHECK_SHA="")
    script = SCRIPT
    if bare:
        checkout = tmp_path / "checkout"
        env["PYTHONPATH"] = str(_bare_copy(checkout))
        env["GPU_CHECK_SHA"] = "bare-copy"
        script = checkout / "scripts" / "gpu_check.sh"
    done = subprocess.run(
        ["bash", str(script), "--cpu", "--out", str(tmp_path), *flags],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    name = "gpu_check_cpu" + ("_short" if "--short" in flags else "")
    name += "_steps" if any(f.startswith("--steps") for f in flags) else ""
    assert (tmp_path / f"{name}.log").is_file(), done.stdout[-2000:] + done.stderr[-2000:]
    return done.returncode, json.loads((tmp_path / f"{name}.json").read_text())


@pytest.mark.slow
def test_the_cpu_mode_runs_every_step_end_to_end_from_a_bare_copy(tmp_path):
    """As the device runs it: a copy of the tracked files, nothing of the project installed and
    no vLLM importable, so gpu_check.sh lays out scripts/device_tree.sh's folder and runs there
    (step 2a's kernel tests included)."""
    rc, report = _check(tmp_path, bare=True)
    statuses = {k: v["status"] for k, v in report["steps"].items()}
    assert list(statuses) == [s.id for s in STEPS]
    assert all(s == "ok" for s in statuses.values()), json.dumps(report["steps"], indent=1)[:4000]
    assert rc == 0 and report["complete"] and report["mode"] == "cpu"
    assert report["git_sha"] and report["card"] == "cpu" and report["machine"]["gpu"] == "cpu"
    steps = report["steps"]
    assert all(isinstance(s["seconds"], float) and s["checks"] for s in steps.values())
    draft = steps["3a_draft_step"]
    assert {(r["batch"], r["context"]) for r in draft["figures"]["rows"]} == {
        (1, 16), (2, 16), (1, 40), (2, 40)
    }  # fmt: skip
    assert all("c_eager" in r and "c_graph" not in r for r in draft["figures"]["rows"])
    assert any("CUDA-graph capture skipped" in n for n in draft["notes"])
    assert steps["1_env"]["checks"]["no_vllm_imported"]
    assert steps["2a_kernel_tests"]["figures"]["tests"] == 3, steps["2a_kernel_tests"]
    assert steps["6_projection"]["figures"]["label"].startswith("PROJECTION")


def test_short_plans_steps_1_to_3_and_the_budget_skips_with_a_reason(tmp_path):
    """--short with no budget: steps 1-3 only, each skipped, and the reason recorded; --steps
    picks steps."""
    rc, report = _check(tmp_path, "--short", "--budget", "0")
    assert rc == 1 and report["short"] and report["complete"]
    assert list(report["steps"]) == SHORT == ["1_env", "2a_kernel_tests", "2b_kernel_bench",
                                              "3a_draft_step", "3b_draft_compile"]  # fmt: skip
    for step in report["steps"].values():
        assert step["status"] == "skipped" and "of the budget left" in step["notes"][0]
    _, report = _check(tmp_path, "--steps=4_engine", "--budget", "0")  # and step 1, always
    assert list(report["steps"]) == ["1_env", "4_engine"]


def test_a_step_killed_by_its_timeout_keeps_what_it_saved(tmp_path):
    part = tmp_path / "part.json"
    part.write_text(json.dumps({"figures": {"rows": [1]}, "checks": {}, "notes": []}))
    step = Step("9_x", "x", "env:run", 10, 1, False)
    entry = record(step, 124, 10.2, part, 10)
    assert entry["status"] == "timeout" and entry["figures"] == {"rows": [1]}
    assert "killed at its 10 s limit" in entry["notes"][0]
    assert record(step, 1, 1.0, tmp_path / "none.json", 10)["status"] == "failed"
    assert record(step, 2, 1.0, part, 10)["status"] == "error"


@pytest.mark.parametrize(
    "card, slug, tbps",
    [
        ("NVIDIA H100 80GB HBM3", "h100", 3.35),
        ("NVIDIA H200", "h200", 4.8),
        ("NVIDIA H100 PCIe", "h100", 2.0),
        ("NVIDIA A100-SXM4-80GB", "a100", 2.039),
        ("NVIDIA GeForce RTX 4090", "geforce_rtx_4090", None),
    ],
)
def test_cards_are_named_and_looked_up(card, slug, tbps):
    assert card_slug(card) == slug
    bandwidth = peak_bandwidth(card)
    assert (bandwidth / 1e12 if bandwidth else None) == tbps
