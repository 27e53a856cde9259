"""The drafter's own paged KV: CA memory K|V and SA K|V of verified tokens, in blocks vLLM manages.

At load time the proposer declares extra vLLM attention layers shaped exactly like the target's
(same KV heads, head size, cache dtype, backend, prefix `vllm_moa.pages.<i>`). vLLM therefore:
- counts them in its KV-cache budget (fewer tokens fit: the drafter's state is no longer hidden
  memory beside vLLM's accounting),
- puts them in the target's KV-cache group, so a request's block table addresses them too,
- frees their blocks with the request's, and on preemption (the request comes back with new
  blocks, which the proposer notices and rewrites).

vLLM never runs attention on these layers; only the proposer reads and writes them, so their
blocks hold our own layout: token slot s of a layer is row s of the layer's cache buffer viewed
as [num_slots, row_width] (row_width = 2 x KV heads x head size of the target). Each field (a
vector per token position, e.g. the CA memory's K|V) takes ceil(width / row_width) layers.
Slots are `block * block_size + offset`, as in the target's cache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from vllm_moa.vllm_plugin.uploads import upload

LAYER_PREFIX = "vllm_moa.pages"


@dataclass(frozen=True)
class Field:
    name: str
    width: int  # values per token position
    first_layer: int
    num_layers: int


def plan_fields(widths: dict[str, int], row_width: int) -> list[Field]:
    """Consecutive page layers per field, each field starting on its own layer."""
    out, layer = [], 0
    for name, width in widths.items():
        n = math.ceil(width / row_width)
        out.append(Field(name, width, layer, n))
        layer += n
    return out


class DrafterPages:
    def __init__(self, widths: dict[str, int], like: Any, vllm_config: Any) -> None:
        """Declare the page layers, shaped like the target attention layer `like`."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.layers.attention.attention import Attention

        self.row_width = 2 * like.num_kv_heads * like.head_size
        self.fields = {f.name: f for f in plan_fields(widths, self.row_width)}
        count = sum(f.num_layers for f in self.fields.values())
        with set_current_vllm_config(vllm_config):
            self.layers = [
                Attention(
                    num_heads=like.num_heads,
                    head_size=like.head_size,
                    scale=1.0,
                    num_kv_heads=like.num_kv_heads,
                    cache_config=vllm_config.cache_config,
                    prefix=f"{LAYER_PREFIX}.{i}",
                    attn_backend=like.attn_backend,
                )
                for i in range(count)
            ]
        for layer in self.layers:
            # Full attention whatever the target's window: our rows must live as long as the
            # request (a sliding-window spec would let vLLM free the early blocks).
            layer.sliding_window = None

    @property
    def layer_names(self) -> list[str]:
        return [a.layer_name for a in self.layers]

    @property
    def bound(self) -> bool:
        return all(a.kv_cache is not None and a.kv_cache.numel() > 0 for a in self.layers)

    def _rows(self, layer: int) -> torch.Tensor:
        """The layer's cache as [num_slots, row_width] over the same memory. Any dense layout
        vLLM picks (CPU: [blocks, heads, block, 2 x head size]; others may permute) serves:
        rows are ours alone, so any bijection from slot numbers onto rows is a valid layout."""
        cache = self.layers[layer].kv_cache
        order = sorted(range(cache.dim()), key=cache.stride, reverse=True)
        dense = cache.permute(order)
        if not dense.is_contiguous() or cache.numel() % self.row_width:
            raise RuntimeError(
                f"vllm_moa: page layer {self.layers[layer].layer_name} got a KV cache of shape "
                f"{tuple(cache.shape)}, strides {cache.stride()}: not one dense buffer that "
                f"splits into rows of {self.row_width}"
            )
        return dense.view(-1, self.row_width)

    def write(self, name: str, slots: torch.Tensor, values: torch.Tensor) -> None:
        """values [N, width] of field `name` at slots [N]."""
        field = self.fields[name]
        for i in range(field.num_layers):
            rows = self._rows(field.first_layer + i)
            part = values[:, i * self.row_width : (i + 1) * self.row_width]
            rows[slots, : part.shape[1]] = part.to(rows.dtype)

    def gather(self, name: str, slots: torch.Tensor) -> torch.Tensor:
        """Field `name` at slots [...]: [..., width]."""
        field = self.fields[name]
        parts = [self._rows(field.first_layer + i)[slots] for i in range(field.num_layers)]
        out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
        return out[..., : field.width]


def block_table(block_ids: list[list[int]], block_size: int, width: int) -> torch.Tensor:
    """Block ids [B, ceil(width / block_size)] covering positions 0..width-1 of each request
    (entries past a request's blocks repeat its first block: garbage, masked out by length)."""
    blocks_per_row = math.ceil(width / block_size)
    table = torch.zeros(len(block_ids), blocks_per_row, dtype=torch.long)
    for i, ids in enumerate(block_ids):
        n = min(len(ids), blocks_per_row)
        table[i, :n] = torch.tensor(ids[:n], dtype=torch.long)
        table[i, n:] = ids[0] if ids else 0
    return table


def slot_grid(
    block_ids: list[list[int]], block_size: int, width: int, device: torch.device
) -> torch.Tensor:
    """Slots [B, width] of positions 0..width-1 of each request (rows past a request's blocks
    point at its first block: garbage, which callers mask out by length)."""
    table = block_table(block_ids, block_size, width)
    positions = torch.arange(width)
    return upload(table[:, positions // block_size] * block_size + positions % block_size, device)
