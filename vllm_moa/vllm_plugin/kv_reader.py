"""Gather the K and V of given token slots from one layer's paged KV cache, per attention backend.

A slot is `block * block_size + offset` in the scheduler's block numbering. A layer's bound
cache tensor is [num_blocks, num_kv_heads, block_size, 2 * head_size] (its block size may be a
kernel block size dividing the scheduler's; slots number tokens the same way). Inside a block:
- FLASH_ATTN / TRITON_ATTN keep K then V in the channel axis: [..., :D] is K, [..., D:] is V;
- CPU_ATTN's C++ kernels pick an in-block arrangement per ISA (vec, vec16, amx, neon, ...; seen
  here: keys stored dimension-major, values token-major). Rather than hard-code each, we learn it:
  `CpuBlockLayout.probe` writes tokens whose elements encode their own (token, head, dim) through
  vLLM's own `cpu_attn_reshape_and_cache` into a scratch block and reads where each landed.
Keys are post-RoPE, as in Hugging Face's cache. Quantized (fp8) caches are refused.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from vllm_moa.model.layers import use_kernels
from vllm_moa.vllm_plugin.uploads import upload

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


class CpuBlockLayout:
    """Where CPU_ATTN puts element (token t, head h, dim d) of K and of V inside one block."""

    def __init__(self, key_index: torch.Tensor, value_index: torch.Tensor) -> None:
        self.key_index = key_index  # long [block_size, H, D]: flat offsets within a block
        self.value_index = value_index

    @classmethod
    def probe(
        cls, num_heads: int, block_size: int, head_size: int, dtype: torch.dtype, isa: str
    ) -> CpuBlockLayout:
        from vllm import _custom_ops as ops

        n = block_size * num_heads * head_size
        ids = torch.arange(n, dtype=torch.long).view(block_size, num_heads, head_size)
        size = num_heads * 2 * block_size * head_size
        found = {w: torch.zeros(size, dtype=torch.long) for w in "kv"}
        written = {w: torch.zeros(size, dtype=torch.bool) for w in "kv"}
        slots = torch.arange(block_size, dtype=torch.long)
        shift = 0
        while (1 << shift) < n:  # one pass per base-16 digit: small integers are exact in bf16
            marks = (((ids >> shift) & 15) + 1).to(dtype)  # 1..16; 0 marks "not written"
            zeros = torch.zeros_like(marks)
            for which, (key, value) in (("k", (marks, zeros)), ("v", (zeros, marks))):
                cache = torch.zeros(1, num_heads, 2 * block_size, head_size, dtype=dtype)
                key_cache, value_cache = cache.chunk(2, dim=2)
                ops.cpu_attn_reshape_and_cache(
                    key, value, key_cache, value_cache, slots, isa,
                    k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto",
                )  # fmt: skip
                flat = cache.reshape(-1).float().round().long()
                written[which] |= flat > 0
                found[which] += (flat - 1).clamp(min=0) << shift
            shift += 4
        positions = torch.arange(size)
        index = {}
        for which in ("k", "v"):
            where = positions[written[which]]
            if where.numel() != n or (written["k"] & written["v"]).any():
                raise RuntimeError(
                    f"could not learn the CPU KV cache layout (isa {isa!r}): {where.numel()} "
                    f"of {n} {which} elements located"
                )
            index[which] = torch.empty(n, dtype=torch.long)
            index[which][found[which][where]] = where
        key_index, value_index = index["k"], index["v"]
        shape = (block_size, num_heads, head_size)
        return cls(key_index.view(shape), value_index.view(shape))


def gather_kv(
    kv_cache: torch.Tensor,
    slots: torch.Tensor,
    backend: str,
    cpu_layout: CpuBlockLayout | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of `slots` [n] from one layer's cache: two [n, num_kv_heads, head_size] tensors."""
    num_blocks, _, block_size, width = kv_cache.shape
    head_size = width // 2
    blocks = torch.div(slots, block_size, rounding_mode="floor")
    offsets = slots % block_size
    if backend in BLOCK_SPLIT_BACKENDS:
        if cpu_layout is None:
            raise ValueError("reading a CPU_ATTN cache needs its probed CpuBlockLayout")
        flat = kv_cache.reshape(num_blocks, -1)
        rows = blocks[:, None, None]
        k = flat[rows, cpu_layout.key_index[offsets]]  # [n, H, D]
        v = flat[rows, cpu_layout.value_index[offsets]]
        return k, v
    if backend in CHANNEL_SPLIT_BACKENDS:
        rows = kv_cache[blocks, :, offsets]  # [n, H, 2D]
        return rows[..., :head_size], rows[..., head_size:]
    raise ValueError(f"unsupported attention backend {backend!r}")


def gather_layer_kv(
    kv_caches: Sequence[torch.Tensor],
    slots: torch.Tensor,
    backend: str,
    cpu_layout: CpuBlockLayout | None = None,
) -> torch.Tensor:
    """LSA's input: K|V rows [n, len(kv_caches), 2 * E_kv] (per layer `[k_h0|v_h0|k_h1|...]`) of
    `slots` [n] from the caches of layers sharing one block table. With kernels on (CUDA; see
    `use_kernels`) and a channel-split backend, one Triton launch reads every layer
    (`vllm_moa.kernels.paged_layer_kv`); otherwise one PyTorch gather per layer."""
    if backend in CHANNEL_SPLIT_BACKENDS and use_kernels(slots.device):
        from vllm_moa.kernels.paged_layer_kv import paged_layer_kv

        head_size = kv_caches[0].shape[-1] // 2
        return paged_layer_kv(
            [c[..., :head_size] for c in kv_caches], [c[..., head_size:] for c in kv_caches], slots
        )
    rows = []
    for cache in kv_caches:
        k, v = gather_kv(cache, slots, backend, cpu_layout)
        rows.append(torch.stack([k, v], dim=2).flatten(1))  # [n, H * 2D]
    return torch.stack(rows, dim=1)


def slots_for_positions(
    block_ids: list[int], block_size: int, start: int, end: int, device: torch.device
) -> torch.Tensor:
    """Slots of token positions start..end-1 of a request whose blocks are `block_ids`."""
    positions = torch.arange(start, end)
    blocks = torch.tensor(block_ids, dtype=torch.long)[positions // block_size]
    return upload(blocks * block_size + positions % block_size, device)
