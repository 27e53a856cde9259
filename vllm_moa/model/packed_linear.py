"""Linear layers on a prepacked oneDNN weight for inference on the CPU.

PyTorch's default CPU `linear` handles the few-row inputs of speculative decoding badly: a fp32
2048 x 5632 weight takes about 2.6 ms for one row, but 5.4 ms for two and 7.7 ms for three (each
row reads the whole weight), so verifying K drafts costs about K plain steps and speculation
cannot pay. oneDNN on a weight reordered once (what vLLM's CPU backend and Inductor's CPU
freezing use) takes 1.1-1.9 ms for 1 to 8 rows. `pack_linears` gives a module's `nn.Linear`s
that kernel for inference: same math, outputs equal to float rounding. With gradients enabled
(training, e.g. through TLI's target layers) a layer runs the default `linear` on its original
weight, which it keeps. `VLLM_MOA_CPU_GEMM=0` turns packing off.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

CPU_GEMM_ENV = "VLLM_MOA_CPU_GEMM"


def packing_available(device: torch.device, dtype: torch.dtype) -> bool:
    return (
        device.type == "cpu"
        and dtype in (torch.float32, torch.bfloat16)
        and os.environ.get(CPU_GEMM_ENV, "1") != "0"
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


class PackedLinear(nn.Module):
    """An `nn.Linear` whose inference runs oneDNN on a prepacked copy of its weight."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        with torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
            return F.linear(x, self.weight, self.bias)
        flat = x.reshape(-1, self.in_features).to(self.weight.dtype).contiguous()
        bias = None if self.bias is None else self.bias.detach()
        out = torch.ops.mkldnn._linear_pointwise(flat, self.packed, bias, "none", [], "")
        return out.reshape(*x.shape[:-1], self.out_features)


def pack_linears(module: nn.Module) -> int:
    """Replace every CPU `nn.Linear` inside `module` by a `PackedLinear` (where oneDNN and the
    setting allow); returns how many were replaced."""
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear) and type(child) is nn.Linear:
            if packing_available(child.weight.device, child.weight.dtype):
                setattr(module, name, PackedLinear(child))
                count += 1
        else:
            count += pack_linears(child)
    return count
