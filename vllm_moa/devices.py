"""Where things run: the default device and the training autocast (CLI, trainer, testbed)."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch


def resolve_device(requested: str | None) -> str:
    """`requested`, or cuda when available else cpu; a clear error for CUDA without a GPU."""
    device = requested or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(
            f"--device {device} asked for, but CUDA is not available; use --device cpu"
        )
    return device


def training_autocast(device: str, mode: str = "auto") -> AbstractContextManager[object]:
    """bf16 autocast (fp32 master weights) for `mode` bf16, or auto on CUDA; none otherwise."""
    use = mode == "bf16" or (mode == "auto" and device.startswith("cuda"))
    return torch.autocast("cuda", dtype=torch.bfloat16) if use else nullcontext()
