#!/usr/bin/env bash
# This checkout laid out as an install lays it out, for a machine where nothing is installed (the
# GPU machine: docs/gpu.md). pyproject installs the top-level kernels/ folder as the package
# vllm_moa.kernels (wheel and editable installs alike); a bare checkout on PYTHONPATH has no such
# package. Prints a new folder holding benchmarks/, scripts/, vllm_moa/ with kernels/ copied in as
# vllm_moa/kernels, the kernel tests the GPU check's step 2a runs (tests/test_kernels.py with the
# conftest and helper it imports, and pyproject.toml for pytest's settings and markers), and
# .gpu_check_sha if present; run from there, e.g.
#
#   cd "$(bash scripts/device_tree.sh)" && python3 -m benchmarks.kernels_gpu --quick
set -euo pipefail
cd "$(dirname "$0")/.."
dest=$(mktemp -d -t vllm-moa-tree.XXXXXX)
cp -r benchmarks scripts vllm_moa "$dest/"
cp -r kernels "$dest/vllm_moa/kernels"
mkdir "$dest/tests"
cp tests/conftest.py tests/deps.py tests/test_kernels.py "$dest/tests/"
cp pyproject.toml "$dest/"
if [ -f .gpu_check_sha ]; then cp .gpu_check_sha "$dest/"; fi
find "$dest" -name __pycache__ -prune -exec rm -rf {} +
echo "$dest"
