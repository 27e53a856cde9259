#!/usr/bin/env bash
# The full check CI runs: lint, format, types, then the whole test suite (slow tests included).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
# pytest exits 5 when it collects nothing: that fails here too, as it should.
.venv/bin/python -m pytest "$@"
