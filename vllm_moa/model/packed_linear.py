"""Linear layers on a prepacked oneDNN weight for inference on the CPU.

PyTorch's default CPU `linear` handles the few-row inputs of speculative decoding badly: a fp32
2048 x 5632 weight takes about 2.6 ms for one row, but 5.4 ms for two and 7.7 ms for three (each
row reads the whole weight), so verifying K drafts costs about K plain steps and speculation
cannot pay. oneDNN on a weight reordered once (what vLLM's CPU backend and Inductor's CPU
freezing use) takes 1.1-1.9 ms for 1 to 8 rows. `pack_linears` gives a module's `nn.Linear`s
that kernel for inference: same math, outputs equal to float rounding. With gradients enabled
(training, e.g. through TLI's target layers) a layer runs the default `linear` on its original
weight, which it keeps. `VLLM_MOA_CPU_GEMM=0` turns packing off.

oneDNN's bf16 path needs AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT; many x86-64 CPUs have neither
(AMD Zen 2/3, many cloud instances), and there reordering a bf16 weight raises. What this CPU's
oneDNN can run is probed once with a tiny layer; a cap below AVX-512 (ONEDNN_MAX_CPU_ISA, which
torch's own bf16 check ignores: it reads CPUID) counts as no bf16. Where bf16 cannot run, bf16
layers are packed in fp32 and their inputs cast: the same products summed in fp32, rounded to
bf16 once at the end, as oneDNN's bf16 kernels do.
"""

from __future__ import annotations

import functools
import logging
import os

import torch
import torch.nn.functional as F
from torch import nn

CPU_GEMM_ENV = "VLLM_MOA_CPU_GEMM"
# oneDNN's ISA caps without a bf16 path (bf16 starts at AVX512_CORE, or AVX2_VNNI_2)
NO_BF16_ISAS = ("SSE41", "AVX", "AVX2", "AVX2_VNNI")
logger = logging.getLogger("vllm_moa")


def packing_available(device: torch.device, dtype: torch.dtype) -> bool:
    return (
        device.type == "cpu"
        and dtype in (torch.float32, torch.bfloat16)
        and os.environ.get(CPU_GEMM_ENV, "1") != "0"
        and packed_dtype(dtype) is not None
    )


def _onednn_runs(dtype: torch.dtype) -> bool:
    """Whether oneDNN reorders and multiplies a tiny `dtype` weight on this CPU."""
    if not (
        torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    ):
        return False
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(torch.ones(8, 8, dtype=dtype), 1)
        x = torch.ones(1, 8, dtype=dtype)
        out = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    except RuntimeError:
        return False
    return bool((out == 8).all())


@functools.cache
def packed_dtype(dtype: torch.dtype) -> torch.dtype | None:
    """The dtype oneDNN packs and multiplies `dtype` weights in on this CPU (None: not at all).
    Probed once per process; falling back from bf16 to fp32 is logged once."""
    if _onednn_runs(dtype):
        return dtype
    if dtype == torch.bfloat16 and _onednn_runs(torch.float32):
        logger.warning(
            "vllm_moa: this CPU's oneDNN has no bf16 path (it needs AVX-512 BW/VL/DQ or "
            "AVX-NE-CONVERT, not capped by ONEDNN_MAX_CPU_ISA; capability here: %s); bf16 "
            "linear layers run packed in fp32 with their inputs cast (the same math, fp32 "
            "weight reads)",
            torch.backends.cpu.get_cpu_capability(),
        )
        return torch.float32
    return None


class PackedLinear(nn.Module):
    """An `nn.Linear` whose inference runs oneDNN on a prepacked copy of its weight."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        # bf16 weights on a CPU whose oneDNN cannot run bf16: packed (and run) in fp32
        self.compute_dtype = packed_dtype(linear.weight.dtype) or linear.weight.dtype
        with torch.no_grad():
            weight = linear.weight.detach().to(self.compute_dtype)
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
        # cast once here, not per call (a no-op view where compute_dtype is the weight's)
        self.packed_bias = (
            None if linear.bias is None else linear.bias.detach().to(self.compute_dtype)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
            return F.linear(x, self.weight, self.bias)
        flat = x.reshape(-1, self.in_features).to(self.compute_dtype).contiguous()
        out = torch.ops.mkldnn._linear_pointwise(
            flat, self.packed, self.packed_bias, "none", [], ""
        )
        return out.to(self.weight.dtype).reshape(*x.shape[:-1], self.out_features)


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
