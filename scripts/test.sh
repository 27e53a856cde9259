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
.venv/bin/python -m pytest -m "" "$@"
