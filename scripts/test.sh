#!/usr/bin/env bash
# The full check CI runs: lint, format, types, then the whole test suite (slow tests included).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
# pytest exits 5 when it collects nothing: that fails here too, as it should. `-m ""` lifts the
# default `-m 'not slow'` of pyproject.toml (a plain `pytest` is the fast local loop).
# Every optional test dependency is installed here: a missing one fails (tests/deps.py).
# scripts/run_pytest.sh names the test that was running if pytest itself dies.
VLLM_MOA_TEST_REQUIRE_ALL=1 bash scripts/run_pytest.sh -m "" "$@"
