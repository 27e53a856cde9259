"""Helpers shared by the kernels' launch wrappers."""

from __future__ import annotations

import torch


def dot_precision(dtype: torch.dtype) -> str:
    """`tl.dot` input precision for a model dtype. fp32 models keep full fp32 products ("ieee");
    the GPU default, TF32 (10-bit mantissa), would change fp32 logits. 16-bit inputs lose nothing
    to TF32 (their mantissa is shorter), so they keep the tensor-core path."""
    return "ieee" if dtype == torch.float32 else "tf32"
