"""The suite tests the default configuration unless a test says otherwise (tests/conftest.py):
no VLLM_MOA_ADAPTIVE for an unmarked test or the processes it starts, VLLM_MOA_ADAPTIVE=0 for a
`fixed_k` one, and a value exported in the shell that runs pytest reaches neither."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_moa.adaptive import ADAPTIVE_ENV, adaptive_enabled

ROOT = Path(__file__).resolve().parents[1]


def _child_sees() -> str:
    """What a process started by the test finds in its environment."""
    code = f"import os; print(os.environ.get({ADAPTIVE_ENV!r}, 'unset'))"
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()


def test_an_unmarked_test_runs_the_default_adaptive_mode():
    assert ADAPTIVE_ENV not in os.environ
    assert adaptive_enabled()
    assert _child_sees() == "unset"


@pytest.mark.fixed_k
def test_a_fixed_k_test_runs_k_every_cycle_and_so_do_its_processes():
    assert os.environ[ADAPTIVE_ENV] == "0"
    assert not adaptive_enabled()
    assert _child_sees() == "0"


@pytest.mark.slow
@pytest.mark.parametrize("shell", ["0", "1"])
def test_the_shells_value_reaches_no_test(shell, tmp_path):
    """pytest started with VLLM_MOA_ADAPTIVE exported: both tests above still see their own mode.
    Control: the same run with a plugin that puts the shell's value back inside each test (after
    the conftest's fixture) fails: the tests above do look at the environment."""
    tests = [
        f"{Path(__file__).relative_to(ROOT)}::{name}"
        for name in (
            "test_an_unmarked_test_runs_the_default_adaptive_mode",
            "test_a_fixed_k_test_runs_k_every_cycle_and_so_do_its_processes",
        )
    ]
    run = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "", *tests]
    env = {**os.environ, ADAPTIVE_ENV: shell}
    done = subprocess.run(run, cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:]
    assert "2 passed" in done.stdout
    # Control: the shell's value put back inside each test makes them fail.
    (tmp_path / "leak_plugin.py").write_text(
        "import os, pytest\n"
        "@pytest.fixture(autouse=True)\n"
        "def _leak(_speculation_mode):\n"
        f"    os.environ[{ADAPTIVE_ENV!r}] = {shell!r}\n"
    )
    path = os.pathsep.join([str(tmp_path), str(ROOT), os.environ.get("PYTHONPATH", "")])
    leaked = subprocess.run(
        [*run[:3], "-p", "leak_plugin", *run[3:]],
        cwd=ROOT, env={**env, "PYTHONPATH": path}, capture_output=True, text=True,
    )  # fmt: skip
    assert leaked.returncode != 0 and " failed" in leaked.stdout, leaked.stdout[-3000:]


@pytest.mark.parametrize("dies", [True, False])
def test_a_pytest_that_dies_names_the_test_it_was_running(dies, tmp_path):
    """scripts/run_pytest.sh (what scripts/test.sh and CI run): a test that kills the process
    (as an illegal instruction in a native module does) is named, with pytest's exit code kept;
    the control, a passing run, prints no such line."""
    body = "import os\n\n\ndef test_fine():\n    pass\n\n\ndef test_dies():\n    os.abort()\n"
    (tmp_path / "test_dying.py").write_text(body if dies else body.split("\n\n\ndef test_dies")[0])
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "run_pytest.sh"), "-q", "-p", "no:cacheprovider",
         str(tmp_path / "test_dying.py")],
        capture_output=True, text=True, timeout=120, env=dict(os.environ, PYTHON=sys.executable),
    )  # fmt: skip
    named = "died of signal 6 with no summary, while running: "
    if dies:
        assert done.returncode == 134, done.stderr[-2000:]
        # the id is relative to pytest's rootdir, which depends on where the checkout lies
        assert re.search(re.escape(named) + r"\S*test_dying\.py::test_dies\n", done.stderr)
    else:
        assert done.returncode == 0 and "died of signal" not in done.stderr
