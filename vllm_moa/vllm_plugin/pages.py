"""The drafter's own paged KV: CA memory K/V and SA K/V of tokens, in blocks vLLM manages.

At load time the proposer declares one extra vLLM attention layer per field, shaped exactly like
the target's (same KV heads, head size, cache dtype, backend, prefix `vllm_moa.pages.<i>`). vLLM
therefore:
- counts them in its KV-cache budget (the drafter's state is no hidden memory beside vLLM's
  accounting),
- puts them in the target's KV-cache group, so a request's block table addresses them too,
- frees their blocks with the request's, and on preemption (the request comes back with new
  blocks, which the proposer notices and rewrites).

vLLM never runs attention on these layers; only the proposer writes and reads them, through
`paged_attention` (whose `page_views` says how a field's K/V sit in a layer's blocks). A field's
K/V must fit one layer: the drafter's KV heads x head size at most the target's.
"""

from __future__ import annotations

from typing import Any

import torch

from vllm_moa.vllm_plugin.paged_attention import PagedKV, fits_one_layer, pages_kv

LAYER_PREFIX = "vllm_moa.pages"


class DrafterPages:
    def __init__(self, fields: dict[str, tuple[int, int]], like: Any, vllm_config: Any) -> None:
        """Declare one page layer per field {name: (KV heads, head size)}, shaped like the
        target attention layer `like`."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.layers.attention.attention import Attention

        for name, (heads, size) in fields.items():
            if not fits_one_layer(like.num_kv_heads, like.head_size, heads, size):
                raise ValueError(
                    f"MoA in vLLM keeps the drafter's {name} K/V ({heads} KV heads of {size}) in "
                    f"page layers shaped like the target's ({like.num_kv_heads} KV heads of "
                    f"{like.head_size}): they do not fit. Use a drafter whose SA / CA KV width "
                    "is at most the target's (the presets halve or quarter it)."
                )
        self.fields = dict(fields)
        with set_current_vllm_config(vllm_config):
            self.layers = {
                name: Attention(
                    num_heads=like.num_heads,
                    head_size=like.head_size,
                    scale=1.0,
                    num_kv_heads=like.num_kv_heads,
                    cache_config=vllm_config.cache_config,
                    prefix=f"{LAYER_PREFIX}.{i}",
                    attn_backend=like.attn_backend,
                )
                for i, name in enumerate(fields)
            }
        for layer in self.layers.values():
            # Full attention whatever the target's window: our rows must live as long as the
            # request (a sliding-window spec would let vLLM free the early blocks).
            layer.sliding_window = None

    @property
    def layer_names(self) -> list[str]:
        return [a.layer_name for a in self.layers.values()]

    @property
    def bound(self) -> bool:
        return all(a.kv_cache is not None and a.kv_cache.numel() > 0 for a in self.layers.values())

    def store(self, name: str, dtype: torch.dtype, backend: str) -> PagedKV:
        """Field `name`'s K/V store in its (bound) page layer."""
        heads, size = self.fields[name]
        return pages_kv(self.layers[name].kv_cache, heads, size, dtype, backend, name)

    def stand_in(
        self,
        name: str,
        dtype: torch.dtype,
        backend: str,
        blocks: int,
        block_size: int,
        device: torch.device | str,
    ) -> PagedKV:
        """A store of field `name` like `store`'s, over a small buffer of its own on `device` (to
        warm up compiled code before vLLM binds the caches): the same store class as serving
        uses, made outside inference mode as vLLM makes its caches."""
        heads, size = self.fields[name]
        like = self.layers[name]
        with torch.inference_mode(False):
            shape = (blocks, like.num_kv_heads, block_size, 2 * like.head_size)
            cache = torch.zeros(shape, dtype=dtype, device=device)
        return pages_kv(cache, heads, size, dtype, backend, name)
