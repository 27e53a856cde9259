"""Attention that reads K/V where they live: in vLLM's paged caches, addressed by block tables.

A `PagedKV` is one K/V store of `num_kv_heads` heads of `head_dim` inside one vLLM layer's cache:
`write` puts the K/V of token slots into it, `attend` runs decode attention for one query per
request (at the request's last position) over the first `seq_lens[b]` positions of the request
whose blocks are `block_table[b]`. Nothing is gathered into dense per-request tensors:

- `CpuPagedKV` (CPU_ATTN): vLLM's own C++ paged-attention and cache-write ops, the ones its CPU
  backend runs for the target.
- `TritonPagedKV` (the GPU backends' pages, where the project's Triton kernels run: see
  `vllm_moa.model.layers.use_kernels`): the paged verification kernel
  (`vllm_moa.kernels.tree_attention`) with one query per request and no tree nodes, so each
  request's K/V are read once, in place, through its block table.
- `TorchPagedKV`: a PyTorch reference, used where neither runs (GPU pages with the kernels
  off) and in tests. It reads each request's blocks through the block table on every call (a
  gather): correct anywhere, but it copies the history each time.

(The TLI tail needs none of this: it runs the target's own layers, with the metadata vLLM's own
attention builders make, see `target_view.run_tail`.)

The drafter's own pages hold only our K/V, so their in-block arrangement is ours to choose:
`page_views` reinterprets each block of a page layer (a dense [heads, 2 x block, dim] buffer on
every backend) as [heads', 2 x block, dim'] for the drafter's head size and uses its first
`num_kv_heads` heads: keys in the first half of the block axis, values in the second, exactly as
the CPU backend views its own caches.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

PADDING_SLOT = -1  # a slot that `write` must not write (vLLM's PADDING_SLOT_ID)


def draft_slots(
    positions: torch.Tensor, ends: torch.Tensor, table: torch.Tensor, block_size: int
) -> torch.Tensor:
    """Slots [B] of each request's drafted position (block table [B, n]); positions at or past
    the request's end (its budget) have no reserved slot: PADDING_SLOT, never written."""
    index = (positions // block_size)[:, None].clamp(max=table.shape[1] - 1)
    slot = table.gather(1, index)[:, 0].long() * block_size + positions % block_size
    return torch.where(positions < ends, slot, PADDING_SLOT)


class PagedKV(Protocol):
    num_kv_heads: int
    head_dim: int

    def write(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> torch.Tensor | None:
        """k, v [N, num_kv_heads, head_dim] at slots [N] (PADDING_SLOT: no request's slot is
        written; an implementation may write vLLM's null block instead). May return a token
        that an `attend` reading these rows takes as `after` (keeps a compiled graph's order)."""

    def attend(
        self,
        q: torch.Tensor,  # [B, H, D]: one query per request, at position seq_lens[b] - 1
        block_table: torch.Tensor,  # int32 [B, n]
        seq_lens: torch.Tensor,  # int32 [B], each >= 1
        window: int | None = None,  # sliding window (keys within the last `window` positions)
        after: torch.Tensor | None = None,  # the token of a `write` this must follow
    ) -> torch.Tensor:
        """Softmax attention (scale head_dim ** -0.5): [B, H, D]."""
        ...


def page_views(
    cache: torch.Tensor, num_kv_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Key and value views [num_blocks, num_kv_heads, block_size, head_dim] over a page layer's
    cache [num_blocks, heads, block_size, 2 * head_size] (the drafter's layout, see above). The
    buffer is taken in its memory order (vLLM may bind it permuted): any bijection from (block,
    head, offset, dim) onto its elements is a valid layout for rows that only we read."""
    blocks, heads, block_size, width = cache.shape
    per_block = heads * width // 2  # values per token and block half (K or V)
    if per_block % head_dim or per_block // head_dim < num_kv_heads:
        raise ValueError(
            f"a page layer holds {per_block} K values per token, too few for "
            f"{num_kv_heads} heads of {head_dim}: this drafter's SA / CA K/V are wider than the "
            "target's K/V of one layer, which paged drafting in vLLM does not support"
        )
    order = sorted(range(cache.dim()), key=cache.stride, reverse=True)
    dense = cache.permute(order)
    if not dense.is_contiguous():
        raise RuntimeError(
            f"vllm_moa: a page layer's KV cache of shape {tuple(cache.shape)}, strides "
            f"{cache.stride()} is not one dense buffer"
        )
    view = dense.view(blocks, per_block // head_dim, 2 * block_size, head_dim)[:, :num_kv_heads]
    key, value = view.chunk(2, dim=2)
    return key, value


def fits_one_layer(like_kv_heads: int, like_head_size: int, kv_heads: int, head_dim: int) -> bool:
    """Whether K/V of `kv_heads` x `head_dim` fit a page layer shaped like the target's."""
    per_block = like_kv_heads * like_head_size
    return per_block % head_dim == 0 and per_block // head_dim >= kv_heads


class TorchPagedKV:
    """Reference implementation over key/value views [num_blocks, Hkv, block_size, D]."""

    def __init__(self, key: torch.Tensor, value: torch.Tensor) -> None:
        self.key, self.value = key, value
        self.num_kv_heads, self.block_size, self.head_dim = key.shape[1:]

    def write(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> torch.Tensor | None:
        # Padding slots go to slot 0, in vLLM's null block (block 0, never given to a request):
        # no data-dependent shapes, so a CUDA graph can capture the write.
        slots = slots.clamp(min=0)
        blocks, offsets = slots // self.block_size, slots % self.block_size
        self.key[blocks, :, offsets] = k.to(self.key.dtype)
        self.value[blocks, :, offsets] = v.to(self.value.dtype)
        return None  # in-place PyTorch ops: a graph keeps their order itself

    def attend(
        self,
        q: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        window: int | None = None,
        after: torch.Tensor | None = None,
    ) -> torch.Tensor:
        table = block_table.long()
        rows, n = table.shape

        def read(cache: torch.Tensor) -> torch.Tensor:  # [B, Hkv, n * block_size, D]
            part = cache[table].transpose(1, 2)  # [B, Hkv, n, block_size, D]
            return part.reshape(rows, self.num_kv_heads, n * self.block_size, self.head_dim)

        k, v = read(self.key), read(self.value)
        cols = torch.arange(k.shape[2], device=q.device)
        lens = seq_lens.long()[:, None]
        visible = cols[None, :] < lens
        if window is not None and window > 0:
            visible &= cols[None, :] >= lens - window
        out = F.scaled_dot_product_attention(
            q[:, :, None].to(k.dtype),
            k,
            v,
            attn_mask=visible[:, None, None, :],
            enable_gqa=q.shape[1] != self.num_kv_heads,
        )
        return out[:, :, 0].to(q.dtype)


class TritonPagedKV(TorchPagedKV):
    """`TorchPagedKV`'s writes; attention by the paged Triton kernel. The kernel attends to a
    paged prefix plus tree nodes under an ancestor mask: here the prefix is the request's first
    seq_lens[b] positions (the query's own K/V were written there first) and the one node is
    masked out, so it contributes nothing. Sliding windows (no caller of ours uses them; the
    target's own layers run in vLLM) take the reference path."""

    # Not traced: the launch has not been run under torch.compile on a GPU yet, so a compiled
    # caller runs it eagerly (a graph break), as it does vLLM's CPU ops.
    @torch.compiler.disable
    def attend(
        self,
        q: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        window: int | None = None,
        after: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if window is not None and window > 0:
            return super().attend(q, block_table, seq_lens, window)
        from vllm_moa.kernels.tree_attention import tree_attention

        rows, _, dim = q.shape
        query = q.to(self.key.dtype)[:, None]  # [B, 1, H, D]
        nothing = query.new_zeros(rows, 1, self.num_kv_heads, dim)
        out = tree_attention(
            query,
            nothing,
            nothing,
            torch.zeros(rows, 1, 1, dtype=torch.bool, device=q.device),  # the node: masked
            torch.ones(rows, dtype=torch.int32, device=q.device),
            self.key.transpose(1, 2),  # [blocks, block_size, Hkv, D] views, any strides
            self.value.transpose(1, 2),
            block_table,
            seq_lens,
        )
        return out[:, 0].to(q.dtype)


class CpuPagedKV:
    """vLLM's CPU_ATTN ops over key/value views [num_blocks, Hkv, block_size, D] (the views
    vLLM's CPU backend makes of a cache, or `page_views`); `isa` picks the in-block
    arrangement (vLLM's choice for the target's layers; any consistent one for our pages).

    vLLM's CPU ops have no fake kernels, so a compiled caller cannot trace them. They run inside
    the project's custom ops `vllm_moa::cpu_pages_write` / `cpu_pages_attend`, which have fake
    kernels: a compiled draft step is one graph, not one per stretch between attention calls
    (every graph entered costs its guards and wrappers at every draft step). The ops name their
    store (`name`) instead of taking its cache views as arguments, as vLLM's own attention ops
    name their layer: a cache passed in and written would be a mutated graph input, which
    Inductor cannot compile with dynamic shapes. So a compiled caller `bind`s its stores first
    (the stores of one name in a process take turns, e.g. two engines' proposers); a direct
    call binds its own store. The write returns a token that the attention after it takes, so
    the compiled graph keeps them in order. Traced code reads none of the store's tensors (only
    its name and dtype), so stores over other buffers reuse the graph: a stand-in made under
    inference mode and vLLM's cache differ in dispatch keys, which a guard would see."""

    def __init__(self, key: torch.Tensor, value: torch.Tensor, isa: str, name: str) -> None:
        self.key, self.value, self.isa, self.name = key, value, isa, name
        self.num_kv_heads, self.block_size, self.head_dim = key.shape[1:]
        self.scale = self.head_dim**-0.5
        self.dtype = key.dtype
        self._starts: torch.Tensor | None = None

    def starts(self, rows: int, device: torch.device) -> torch.Tensor:
        """Query start offsets 0..rows (one query per request), kept between calls."""
        if self._starts is None or self._starts.shape[0] != rows + 1:
            self._starts = torch.arange(rows + 1, dtype=torch.int32, device=device)
        return self._starts

    @classmethod
    def for_pages(
        cls, cache: torch.Tensor, num_kv_heads: int, head_dim: int, dtype: torch.dtype, name: str
    ) -> CpuPagedKV:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        key, value = page_views(cache, num_kv_heads, head_dim)
        return cls(key, value, _get_attn_isa(dtype, cache.shape[2], head_dim, "auto"), name)

    def bind(self) -> None:
        """Make this store the one the ops act on under its name."""
        _BOUND[self.name] = self

    def write(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        if not torch.compiler.is_compiling():
            self.bind()
        token: torch.Tensor = torch.ops.vllm_moa.cpu_pages_write(
            k.to(self.dtype).contiguous(), v.to(self.dtype).contiguous(), slots, self.name
        )
        return token

    def attend(
        self,
        q: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        window: int | None = None,
        after: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if not torch.compiler.is_compiling():
            self.bind()
        window_size = window if window is not None and window > 0 else -1
        query = q.to(self.dtype).contiguous()
        token = after if after is not None else query.new_empty(0)
        out = torch.ops.vllm_moa.cpu_pages_attend(
            query, block_table, seq_lens, window_size, self.name, token
        )
        return out.to(q.dtype)


_BOUND: dict[str, CpuPagedKV] = {}  # the store each name stands for now (`CpuPagedKV.bind`)


@torch.library.custom_op("vllm_moa::cpu_pages_write", mutates_args=())
def _cpu_pages_write(
    k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, name: str
) -> torch.Tensor:
    """k, v [N, Hkv, D] into the bound store `name` at `slots` (vLLM's cache write); returns
    an empty token for the attention that must come after."""
    from vllm import _custom_ops as ops

    store = _BOUND[name]
    ops.cpu_attn_reshape_and_cache(k, v, store.key, store.value, slots, store.isa)
    return k.new_empty(0)


_cpu_pages_write.register_fake(lambda k, *_: k.new_empty(0))


@torch.library.custom_op("vllm_moa::cpu_pages_attend", mutates_args=())
def _cpu_pages_attend(
    query: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    window: int,
    name: str,
    after: torch.Tensor,
) -> torch.Tensor:
    """Decode attention [B, H, D] of one query per request over its pages in the bound store
    `name` (vLLM's op); `after`: the token of a write it must follow."""
    from vllm import _custom_ops as ops

    store = _BOUND[name]
    rows = query.shape[0]
    starts = store.starts(rows, query.device)
    metadata = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=rows,
        num_heads=query.shape[1],
        num_kv_heads=store.num_kv_heads,
        head_dim=store.head_dim,
        seq_lens=seq_lens,
        dtype=query.dtype,
        query_start_loc=starts,
        causal=True,
        sliding_window_size=window,
        isa=store.isa,
        enable_kv_split=False,
    )
    out = torch.empty_like(query)
    ops.cpu_attention_with_kv_cache(
        query=query,
        key_cache=store.key,
        value_cache=store.value,
        output=out,
        query_start_loc=starts,
        seq_lens=seq_lens,
        scale=store.scale,
        causal=True,
        alibi_slopes=None,
        sliding_window=window,
        block_table=block_table,
        softcap=0.0,
        scheduler_metadata=metadata,
        s_aux=None,
    )
    return out


_cpu_pages_attend.register_fake(lambda query, *_: torch.empty_like(query))


def bind_stores(stores: dict[str, PagedKV]) -> None:
    """Bind the stores a compiled step is about to use (`CpuPagedKV.bind`; others need none)."""
    for store in stores.values():
        if isinstance(store, CpuPagedKV):
            store.bind()


def pages_kv(
    cache: torch.Tensor,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    backend: str,
    name: str = "pages",
) -> PagedKV:
    """A store in one of the drafter's page layers, for the layer's attention backend; `name`
    tells a proposer's stores apart (`CpuPagedKV`)."""
    if backend == "CPU_ATTN":
        return CpuPagedKV.for_pages(cache, num_kv_heads, head_dim, dtype, name)
    from vllm_moa.model.layers import use_kernels

    store = TritonPagedKV if use_kernels(cache.device) else TorchPagedKV
    return store(*page_views(cache, num_kv_heads, head_dim))
