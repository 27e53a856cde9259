"""Gather the K and V of given token slots from one layer's paged KV cache, per attention backend.

A slot is `block * block_size + offset` in the scheduler's block numbering. A layer's bound
cache tensor is [num_blocks, num_kv_heads, block_size, 2 * head_size] in both families below
(its block size may be a kernel block size dividing the scheduler's; slots number tokens the
same way); they differ in where V sits:
- CPU_ATTN packs each block as all keys, then all values: view [B, H, 2 * N, D], K rows 0..N-1;
- FLASH_ATTN / TRITON_ATTN keep K then V in the channel axis: [..., :D] is K, [..., D:] is V.
Keys are post-RoPE, as in Hugging Face's cache. Quantized (fp8) caches are refused.
"""

from __future__ import annotations

import torch

CHANNEL_SPLIT_BACKENDS = ("FLASH_ATTN", "TRITON_ATTN", "FLEX_ATTENTION")
BLOCK_SPLIT_BACKENDS = ("CPU_ATTN",)
SUPPORTED_BACKENDS = BLOCK_SPLIT_BACKENDS + CHANNEL_SPLIT_BACKENDS


def check_backend(backend: str, kv_cache_dtype: str) -> None:
    if backend not in SUPPORTED_BACKENDS:
        raise ValueError(
            f"MoA reads the target's paged KV cache, whose layout depends on the attention "
            f"backend; backend {backend!r} is not supported (supported: "
            f"{', '.join(SUPPORTED_BACKENDS)}). Select one with --attention-backend."
        )
    if kv_cache_dtype not in ("auto", "bfloat16", "float16", "float32"):
        raise ValueError(
            f"MoA does not read quantized KV caches yet (kv_cache_dtype={kv_cache_dtype!r}): "
            "serve with --kv-cache-dtype auto."
        )


def gather_kv(
    kv_cache: torch.Tensor, slots: torch.Tensor, backend: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of `slots` [n] from one layer's cache: two [n, num_kv_heads, head_size] tensors."""
    num_blocks, num_heads, block_size, width = kv_cache.shape
    head_size = width // 2
    blocks = torch.div(slots, block_size, rounding_mode="floor")
    offsets = slots % block_size
    if backend in BLOCK_SPLIT_BACKENDS:
        packed = kv_cache.view(num_blocks, num_heads, 2 * block_size, head_size)
        k = packed[blocks, :, offsets]  # [n, H, D]
        v = packed[blocks, :, offsets + block_size]
        return k, v
    if backend in CHANNEL_SPLIT_BACKENDS:
        rows = kv_cache[blocks, :, offsets]  # [n, H, 2D]
        return rows[..., :head_size], rows[..., head_size:]
    raise ValueError(f"unsupported attention backend {backend!r}")


def slots_for_positions(
    block_ids: list[int], block_size: int, start: int, end: int, device: torch.device
) -> torch.Tensor:
    """Slots of token positions start..end-1 of a request whose blocks are `block_ids`."""
    positions = torch.arange(start, end)
    blocks = torch.tensor(block_ids, dtype=torch.long)[positions // block_size]
    return (blocks * block_size + positions % block_size).to(device)
