"""Helpers shared by the kernels' launch wrappers."""

from __future__ import annotations

import math

import torch

LOG2_E = 1.0 / math.log(2.0)  # softmax in base 2: exp(x) = exp2(x * log2(e))


def dot_precision(dtype: torch.dtype) -> str:
    """`tl.dot` input precision for a model dtype. fp32 models keep full fp32 products ("ieee");
    the GPU default, TF32 (10-bit mantissa), would change fp32 logits. 16-bit inputs go to the
    tensor cores as they are (the setting only applies to fp32 operands)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def check_tile(name: str, value: int, least: int) -> int:
    """A tile size given by a caller (benchmarks sweep them): a power of two, at least `least`
    (tl.dot needs 16 rows, columns and depth)."""
    if value < least or value & (value - 1):
        raise ValueError(f"{name}={value}: use a power of two >= {least}")
    return value
