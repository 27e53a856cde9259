"""The proposer's hot functions under torch.compile, as vLLM compiles the target.

A draft step on a decode batch is dozens of small ops (norms, rotary embeddings, residuals,
SwiGLU) around a few GEMMs and two paged-attention calls: run eagerly, per-op overhead dominates
it. Compiled with Inductor, the ops between the attention calls fuse. On the CPU the step is
one graph: `CpuPagedKV` runs vLLM's attention ops inside custom ops of the project's with fake
kernels (one graph instead of nine took 12% off a draft step at batch 1 on the inflated pair).
`TritonPagedKV`, the GPU layouts' paged kernel, is `torch.compiler.disable`d until it has been
traced on a GPU: there the step compiles as a few graphs split at attention, as vLLM splits its
own piecewise graphs; with the PyTorch paged reference it is one graph.

On by default wherever vLLM compiles the target (`--enforce-eager` turns both off);
`VLLM_MOA_COMPILE=0` keeps the proposer eager, `1` compiles it even with an eager target.
Shapes are dynamic (one graph for every batch size from 2, one for batch 1), warmed up at load
time so that no request waits for a compile.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, ParamSpec, TypeVar

import torch
import torch.fx.experimental._config as fx_config

from vllm_moa.switches import env_switch

COMPILE_ENV = "VLLM_MOA_COMPILE"

P = ParamSpec("P")
R = TypeVar("R")


def compile_wanted(vllm_config: Any) -> bool:
    """Whether the proposer compiles: `VLLM_MOA_COMPILE` if set (1 / 0), else whether vLLM
    compiles the target (its compilation mode is not NONE, e.g. no `--enforce-eager`)."""
    switch = env_switch(COMPILE_ENV)
    if switch is not None:
        return switch
    if getattr(vllm_config.model_config, "enforce_eager", False):
        return False
    return int(getattr(vllm_config.compilation_config, "mode", 0) or 0) != 0


class Compiled(Generic[P, R]):
    """`fn` under torch.compile with dynamic shapes; `warm` compiles it for some arguments."""

    def __init__(self, fn: Callable[P, R]) -> None:
        self.fn = fn
        self._compiled = torch.compile(fn, dynamic=True)

    def warm(self, *args: P.args, **kwargs: P.kwargs) -> R:
        # Without duck shaping, a size that happens to equal another one while tracing (a batch
        # of 2 and 2 heads) does not become a guard that recompiles at every other batch size.
        with fx_config.patch(use_duck_shape=False):  # type: ignore[attr-defined]
            return self._compiled(*args, **kwargs)

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        return self._compiled(*args, **kwargs)
