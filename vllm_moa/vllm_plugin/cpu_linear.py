"""The drafter's linear layers through vLLM's own CPU GEMM dispatch, as the target's run.

On the CPU, vLLM does not run its linear layers with `torch.nn.functional.linear`: at load time
`dispatch_cpu_unquantized_gemm` picks a kernel per weight (oneDNN with a prepacked weight, or
sgl-kernel's packed GEMM for small ones), which reads a decode step's weights markedly faster.
The drafter's layers are plain `nn.Linear`s; at batch 1 drafting is memory-bound on exactly
those weights, so on the CPU the proposer gives them the same dispatch. Same math, another
kernel: outputs agree to float rounding (tested), drafts to the token in the vLLM tests.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class DispatchedLinear(nn.Module):
    """An `nn.Linear`'s weights behind vLLM's CPU GEMM (inputs of any leading shape)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

        self.weight = linear.weight
        self.bias = linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.cpu_linear: Any = None
        dispatch_cpu_unquantized_gemm(self, remove_weight=False)  # sets self.cpu_linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).contiguous()
        out = self.cpu_linear(flat, self.weight, self.bias)
        return out.reshape(*x.shape[:-1], self.out_features)


def dispatch_linears(module: nn.Module) -> int:
    """Replace every `nn.Linear` in `module` (in place) by a `DispatchedLinear`; returns how
    many were replaced."""
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            setattr(module, name, DispatchedLinear(child))
            count += 1
        else:
            count += dispatch_linears(child)
    return count
