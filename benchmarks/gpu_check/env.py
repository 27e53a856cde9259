"""Step 1: the machine (versions, card, bandwidth) and that the project runs on its packages as
they are: nothing installed, vLLM absent (every module below must import without it)."""

from __future__ import annotations

import importlib
import importlib.util
import platform
import subprocess
import sys

import torch

from benchmarks.gpu_check.common import StepContext, timer
from benchmarks.gpu_check.plan import peak_bandwidth

# What the check runs: everything of vllm_moa that must not need vLLM (the vLLM integration's
# drafting core and page stores included: step 3 drives them directly).
VLLM_FREE = (
    "vllm_moa.kernels.layer_attention",
    "vllm_moa.kernels.paged_layer_kv",
    "vllm_moa.kernels.tree_attention",
    "vllm_moa.drafters.presets",
    "vllm_moa.drafters.moa.model",
    "vllm_moa.drafters.moa.proposer",
    "vllm_moa.hf_target",
    "vllm_moa.decoding",
    "vllm_moa.training.trainer",
    "vllm_moa.factories.methods",
    "vllm_moa.vllm_plugin.paged_attention",
    "vllm_moa.vllm_plugin.drafting",
    "vllm_moa.vllm_plugin.compiled",
    "benchmarks.kernels_gpu",
    "benchmarks.cost_model",
)


def _versions() -> dict[str, str | None]:
    import transformers

    try:
        import triton

        triton_version: str | None = triton.__version__
    except ImportError:
        triton_version = None
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton_version,
        "transformers": transformers.__version__,
    }


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:  # a finder that refuses the name
        return False


def _imports(ctx: StepContext) -> None:
    failed = {}
    for name in VLLM_FREE:
        try:
            importlib.import_module(name)
        except Exception as e:  # every failure is a finding: record them all
            failed[name] = f"{type(e).__name__}: {e}"[:300]
    vllm_loaded = sorted(m for m in sys.modules if m == "vllm" or m.startswith("vllm."))
    ctx.part.figures.update(import_failures=failed, vllm_modules_loaded=vllm_loaded[:10])
    ctx.part.check("project_imports", not failed)
    ctx.part.check("no_vllm_imported", not vllm_loaded)


def _card(ctx: StepContext) -> None:
    part = ctx.part
    if not part.check("cuda_available", torch.cuda.is_available()):
        return
    props = torch.cuda.get_device_properties(0)
    card = torch.cuda.get_device_name(0)
    bandwidth = peak_bandwidth(card)
    part.figures.update(
        card=card,
        capability=f"{props.major}.{props.minor}",
        multiprocessors=props.multi_processor_count,
        memory_gib=round(props.total_memory / 2**30, 1),
        peak_bandwidth_TBps=bandwidth / 1e12 if bandwidth else "unknown",
    )
    try:
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version,clocks.max.sm", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        part.figures["nvidia_smi"] = smi.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        part.figures["nvidia_smi"] = None
    src = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = timer("cuda")(lambda: dst.copy_(src))
    copy = 2 * src.numel() / (ms * 1e-3)  # bytes read + written per second
    part.figures["copy_bandwidth_TBps"] = copy / 1e12
    if bandwidth:
        part.figures["copy_fraction_of_peak"] = copy / bandwidth


def _smoke(ctx: StepContext) -> None:
    """A GEMM in the run's dtype and one Triton kernel launch, each against PyTorch in fp32."""
    from vllm_moa.kernels.paged_layer_kv import paged_layer_kv, paged_layer_kv_ref

    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(2, 256, 256, generator=g).to(ctx.device)
    got = (a.to(ctx.dtype) @ b.to(ctx.dtype)).float()
    err = float((got - a @ b).abs().max() / (a @ b).abs().max())
    ctx.part.figures["gemm_relative_error"] = err
    ctx.part.check("gemm", err < 2e-2)  # bf16 keeps 8 bits: ~4e-3 per product, sums average
    caches = [torch.randn(4, 2, 16, 64, generator=g).to(ctx.device, ctx.dtype) for _ in range(3)]
    keys, values = [c[..., :32] for c in caches], [c[..., 32:] for c in caches]
    slots = torch.randperm(64, generator=g)[:9].to(ctx.device)
    same = torch.equal(paged_layer_kv(keys, values, slots), paged_layer_kv_ref(keys, values, slots))
    ctx.part.check("triton_kernel_runs", same)  # a copy: exact


def run(ctx: StepContext) -> None:
    part = ctx.part
    part.figures["versions"] = _versions()
    part.figures["vllm_installed"] = _installed("vllm")
    part.figures["card"] = "cpu"
    part.save()
    _imports(ctx)
    part.save()
    if ctx.cpu:
        part.notes.append("CPU mode: Triton runs in its interpreter; no card to look up")
    else:
        _card(ctx)
    part.save()
    _smoke(ctx)
