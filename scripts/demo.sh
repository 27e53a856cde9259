#!/usr/bin/env bash
# The quick start: build (once, cached) a tiny target + MoA drafter and generate with both.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/vllm-moa demo "$@"
