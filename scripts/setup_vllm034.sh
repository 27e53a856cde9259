#!/usr/bin/env bash
# A separate virtual environment holding vLLM 0.34.0's Python modules, for the config-level test
# of the plugin's 0.34 path (tests/test_vllm034_registry.py). vLLM 0.34 has no CPU build, so no
# engine runs there; its config classes, its speculator registry and its plugin loader do.
#
#   bash scripts/setup_vllm034.sh      # -> ${VLLM_MOA_CACHE:-~/.cache/vllm_moa}/venv-vllm034
#
# Installs torch==2.14.0 (vLLM 0.34's pin; the CPU build where download.pytorch.org answers, else
# PyPI's CUDA build, which imports and runs on a CPU: ~3 GB with its CUDA libraries),
# `vllm==0.34.0 --no-deps`, then vLLM's remaining requirements as its wheel lists them
# (Requires-Dist) less the GPU-only compiled ones and the media packages whose CUDA builds break
# vLLM's imports on a CPU (SKIP below), together with this project's own dependencies so pip picks
# versions both accept. The project itself is not installed: the test puts the checkout on
# PYTHONPATH and declares its entry point, so one environment serves every checkout. Re-running
# is a no-op until this script changes. Does not touch .venv.
set -euo pipefail
cd "$(dirname "$0")/.."
CACHE=${VLLM_MOA_CACHE:-$HOME/.cache/vllm_moa}
VENV=${VLLM_MOA_VENV_034:-$CACHE/venv-vllm034}
PYTHON=${PYTHON:-python3}
VLLM_VERSION=0.34.0
TORCH_VERSION=2.14.0
# GPU-only compiled packages (CUDA kernels, NVIDIA codecs) and the CUDA builds of
# torchvision / torchaudio / torchcodec (`operator torchvision::nms does not exist` on a CPU).
SKIP="flashinfer-python apache-tvm-ffi tilelang nvidia-cudnn-frontend nvtx fastsafetensors
instanttensor nvidia-cutlass-dsl quack-kernels tokenspeed-mla humming-kernels pynvvideocodec
torchaudio torchvision torchcodec torch"

if [ ! -x "$VENV/bin/python" ]; then
  mkdir -p "$(dirname "$VENV")"
  "$PYTHON" -m venv "$VENV"
fi
pip=("$VENV/bin/python" -m pip)
stamp=$VENV/.vllm_moa_installed
want=$(cat scripts/setup_vllm034.sh pyproject.toml | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
  exit 0
fi
"${pip[@]}" install -q --upgrade pip packaging
if curl -sfI --max-time 10 https://download.pytorch.org/whl/cpu/ >/dev/null 2>&1; then
  "${pip[@]}" install -q "torch==$TORCH_VERSION" --index-url https://download.pytorch.org/whl/cpu
else
  "${pip[@]}" install -q "torch==$TORCH_VERSION"
fi
"${pip[@]}" install -q --no-deps "vllm==$VLLM_VERSION"
reqs=$(mktemp)
trap 'rm -f "$reqs"' EXIT
SKIP=$SKIP "$VENV/bin/python" - >"$reqs" <<'EOF'
"""vLLM's requirements (its installed metadata) for this machine, less SKIP and extras, plus
this project's own dependencies (pyproject.toml), one per line."""
import importlib.metadata
import os
import tomllib

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

skip = {canonicalize_name(n) for n in os.environ["SKIP"].split()}
for line in importlib.metadata.requires("vllm") or []:
    req = Requirement(line)
    if canonicalize_name(req.name) in skip:
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue  # an extra, or another platform
    req.marker = None
    print(req)
with open("pyproject.toml", "rb") as f:
    for line in tomllib.load(f)["project"]["dependencies"]:
        if canonicalize_name(Requirement(line).name) not in skip:
            print(line)
EOF
# pip then reports vLLM's skipped requirements as conflicts ("vllm 0.34.0 requires ..., which is
# not installed"): expected, they are the GPU-only ones.
"${pip[@]}" install -q -r "$reqs"
"$VENV/bin/python" -c "import vllm, torch; print('vLLM', vllm.__version__, 'torch', torch.__version__)"
echo "$want" >"$stamp"
