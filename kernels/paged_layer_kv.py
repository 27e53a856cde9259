"""LSA's input straight from the target's paged KV caches: every layer's K|V of given slots.

key_caches[l], value_caches[l]: [num_blocks, Hkv, block_size, D] views of layer l's paged cache
(any strides, the same for every layer, unit stride over D; vLLM's FLASH_ATTN / TRITON_ATTN
cache [num_blocks, Hkv, block_size, 2D] gives them as cache[..., :D] and cache[..., D:]).
slots: [N] integers `block * block_size + offset`. Output: [N, L, Hkv * 2D], per layer
`[k_h0 | v_h0 | k_h1 | v_h1 | ...]` (MOA_SPEC's LSA row), ready for LSA's RMSNorm.

One program per (token, layer) copies that layer's Hkv x D tile of K and of V: one launch for
all L layers (the layers' caches are separate allocations, reached through a table of base
pointers) instead of L gathers plus a stack. It is pure data movement, so its figure of merit is
bandwidth (benchmarks/kernels_gpu.py compares it with a device-to-device copy). The gather is not
fused further into LSA: LSA's RMSNorm and q/k/v projections (GEMMs) sit between the gathered rows
and the layer-axis attention (`layer_attention.py`), and the mean over layers comes after LSA's
MLP, so neither fuses with the attention.
Slots are not range-checked on the device (that would cost a host sync per call): callers pass
slots from the scheduler's block tables, as vLLM's own cache kernels assume. The base-pointer
tables are built once per set of caches (a host-to-device copy waits for the device; vLLM's
caches never move, so later calls reuse them).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the reference below still works
    triton = None


_POINTER_TABLES: dict[tuple[torch.device, tuple[int, ...]], tuple[torch.Tensor, bool]] = {}


def _pointer_table(caches: Sequence[torch.Tensor]) -> tuple[torch.Tensor, bool]:
    """int64 [L] of the caches' base addresses on their device, and whether every address is a
    multiple of 16 bytes (the kernel's ALIGNED); a pure function of the addresses, so a cached
    entry is never stale."""
    key = (caches[0].device, tuple(c.data_ptr() for c in caches))
    entry = _POINTER_TABLES.get(key)
    if entry is None:
        if len(_POINTER_TABLES) >= 64:  # bounded: serving uses a handful of cache sets
            _POINTER_TABLES.clear()
        table = torch.tensor(key[1], dtype=torch.int64, device=key[0])
        entry = _POINTER_TABLES[key] = (table, all(a % 16 == 0 for a in key[1]))
    return entry


def paged_layer_kv_ref(
    key_caches: Sequence[torch.Tensor], value_caches: Sequence[torch.Tensor], slots: torch.Tensor
) -> torch.Tensor:
    """Plain PyTorch: index every layer's blocks, interleave K and V per head, stack layers."""
    block_size = key_caches[0].shape[2]
    blocks, offsets = slots // block_size, slots % block_size
    rows = [
        torch.stack([k[blocks, :, offsets], v[blocks, :, offsets]], dim=2).flatten(1)
        for k, v in zip(key_caches, value_caches, strict=True)
    ]
    return torch.stack(rows, dim=1)


if triton is not None:

    @triton.jit
    def _paged_layer_kv_kernel(
        key_table,  # int64 [L]: base address of each layer's key view
        value_table,  # int64 [L]
        slots_ptr,  # [N]
        out_ptr,  # [N, L, Hkv * 2D]
        stride_block,
        stride_head,
        stride_token,
        stride_on,
        stride_ol,
        block_size,
        num_heads,
        head_dim,
        BLOCK_H: tl.constexpr,
        BLOCK_D: tl.constexpr,
        ALIGNED: tl.constexpr,  # every base address is a multiple of 16 bytes
    ):
        n = tl.program_id(0)
        layer = tl.program_id(1)
        slot = tl.load(slots_ptr + n).to(tl.int64)
        block = slot // block_size
        offset = slot % block_size
        elem = tl.pointer_type(out_ptr.dtype.element_ty)
        key_base = tl.load(key_table + layer).to(elem)
        value_base = tl.load(value_table + layer).to(elem)
        if ALIGNED:
            # addresses read from a table carry no alignment the compiler can see: without
            # this hint it loads element by element, with it 16 bytes at a time
            key_base = tl.multiple_of(key_base, 16)
            value_base = tl.multiple_of(value_base, 16)
        heads = tl.arange(0, BLOCK_H)
        dims = tl.arange(0, BLOCK_D)
        ok = (heads[:, None] < num_heads) & (dims[None, :] < head_dim)
        src = block * stride_block + offset * stride_token + heads[:, None] * stride_head
        src = src + dims[None, :]
        k = tl.load(key_base + src, mask=ok)
        v = tl.load(value_base + src, mask=ok)
        dst = out_ptr + n * stride_on + layer * stride_ol + heads[:, None] * (2 * head_dim)
        dst = dst + dims[None, :]
        tl.store(dst, k, mask=ok)
        tl.store(dst + head_dim, v, mask=ok)


def _check(key_caches: Sequence[torch.Tensor], value_caches: Sequence[torch.Tensor]) -> None:
    if not key_caches or len(key_caches) != len(value_caches):
        raise ValueError(
            f"need one key and one value cache per layer; got {len(key_caches)} key and "
            f"{len(value_caches)} value caches"
        )
    first = key_caches[0]
    if first.dim() != 4:
        raise ValueError(
            f"caches must be [num_blocks, Hkv, block_size, D] views; got {tuple(first.shape)}"
        )
    for i, cache in enumerate([*key_caches, *value_caches]):
        if (
            cache.shape != first.shape
            or cache.stride() != first.stride()
            or cache.dtype != first.dtype
            or cache.device != first.device
        ):
            which = f"{'value' if i >= len(key_caches) else 'key'} cache {i % len(key_caches)}"
            raise ValueError(
                f"{which} is {tuple(cache.shape)} / strides {cache.stride()} / {cache.dtype} on "
                f"{cache.device}; every layer must match key cache 0 ({tuple(first.shape)} / "
                f"{first.stride()} / {first.dtype} on {first.device})"
            )
    if first.stride(-1) != 1:
        raise ValueError("caches need unit stride over the head dimension")


def paged_layer_kv(
    key_caches: Sequence[torch.Tensor], value_caches: Sequence[torch.Tensor], slots: torch.Tensor
) -> torch.Tensor:
    """Validated launch of the Triton kernel; shapes as in the module docstring."""
    if triton is None:
        raise RuntimeError(
            "paged_layer_kv needs Triton (pip install triton); use paged_layer_kv_ref"
        )
    _check(key_caches, value_caches)
    if slots.dim() != 1 or slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slots must be a 1-D integer tensor; got {slots.dtype} {slots.shape}")
    first = key_caches[0]
    if slots.device != first.device:
        raise ValueError(f"slots are on {slots.device}, the caches on {first.device}")
    _, heads, block_size, head_dim = first.shape
    layers = len(key_caches)
    out = torch.empty(
        slots.shape[0], layers, heads * 2 * head_dim, dtype=first.dtype, device=first.device
    )
    if slots.shape[0] == 0:
        return out
    block_h, block_d = triton.next_power_of_2(heads), triton.next_power_of_2(head_dim)
    key_table, keys_aligned = _pointer_table(key_caches)
    value_table, values_aligned = _pointer_table(value_caches)
    _paged_layer_kv_kernel[(slots.shape[0], layers)](
        key_table,
        value_table,
        slots,
        out,
        first.stride(0),
        first.stride(1),
        first.stride(2),
        out.stride(0),
        out.stride(1),
        block_size,
        heads,
        head_dim,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        ALIGNED=keys_aligned and values_aligned,
        # at least 16 bytes of the tile per thread, so each load is one 16-byte access (4 warps
        # over Qwen2-7B's 4 x 128 bf16 tile left 8 bytes a thread: benchmarks/kernels_aot.py)
        num_warps=max(1, min(4, block_h * block_d * first.element_size() // (32 * 16))),
    )
    return out
