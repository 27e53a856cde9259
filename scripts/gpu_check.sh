#!/usr/bin/env bash
# The GPU check (issue 44) in one device call: every step in its own process under its own
# timeout, most important first, within a 420 s budget; one results JSON (rewritten after each
# step) and one log, named after the card, in $OUT (else benchmarks/results/gpu_check/).
# docs/gpu.md.
#
#   bash scripts/gpu_check.sh            # the whole check (device tool: timeout_s 480)
#   bash scripts/gpu_check.sh --short    # steps 1-3 only, a rerun after a fix
#   bash scripts/gpu_check.sh --cpu      # tiny shapes on the CPU (automatic without CUDA)
#
# Nothing is installed on the device: the machine's torch, triton and transformers run this
# checkout, without vLLM, from a copy laid out as an install lays it out (scripts/device_tree.sh:
# kernels/ as vllm_moa/kernels). GPU_CHECK_SHA names the commit where the tree has no .git.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -n "${PYTHON:-}" ]; then
  py=$PYTHON
elif [ -x .venv/bin/python ]; then
  py=.venv/bin/python  # this checkout's environment (not on the device: .venv stays behind)
else
  py=python3
fi
if ! "$py" -c "import importlib.util as u; exit(u.find_spec('vllm_moa.kernels') is None)" \
    2>/dev/null; then
  cd "$(bash scripts/device_tree.sh)"  # not installed here
fi
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "$py" -m benchmarks.gpu_check "$@"
