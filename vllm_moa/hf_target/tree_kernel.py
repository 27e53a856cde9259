"""Tree verification through our Triton kernel inside Hugging Face attention layers (CUDA).

`HFTarget.forward_tree` runs the target's own layers; while it does, with kernels enabled
(`vllm_moa.model.layers.use_kernels`), the layers' attention function is ours: it feeds the
layer's cache (the verified prefix, then the tree's nodes just appended) to
`vllm_moa.kernels.tree_attention` as a one-page paged cache with the tree's ancestor mask, and
falls back to PyTorch SDPA with the additive mask where the kernel does not apply (a
non-standard softmax scale or logit soft-capping; models with sliding windows are not routed).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

NAME = "vllm_moa_tree"
KWARG = "moa_tree"


@dataclass
class TreeKernelArgs:
    """What every layer's kernel call shares in one tree verification (built once, on device)."""

    mask: torch.Tensor  # bool [1, T, T]: node i sees node j (self / ancestors)
    prefix: int  # cached tokens before the tree (every layer: no sliding windows here)
    num_nodes: torch.Tensor  # [1] = T
    prefix_lens: torch.Tensor  # [1] = prefix
    page_table: torch.Tensor  # int32 [1, 1]: the layer's cache is one page


def kernel_args(allowed: torch.Tensor, prefix: int, device: torch.device) -> TreeKernelArgs:
    nodes = allowed.shape[0]
    return TreeKernelArgs(
        mask=allowed.to(device)[None],
        prefix=prefix,
        num_nodes=torch.full((1,), nodes, device=device),
        prefix_lens=torch.full((1,), prefix, device=device),
        page_table=torch.zeros(1, 1, dtype=torch.int32, device=device),
    )


def routable(target_config: Any, windows: list[int | None]) -> bool:
    """Whether forward_tree may route this model's attention through us: SDPA layers (our
    fallback) and no sliding window anywhere."""
    return target_config._attn_implementation == "sdpa" and all(w is None for w in windows)


def _kernel_applies(module: Any, query: torch.Tensor) -> bool:
    # (sliding windows never get here: `routable` keeps such models on SDPA)
    return (
        not getattr(module, "attn_logit_softcapping", None)
        and abs(float(getattr(module, "scaling", 0.0)) - query.shape[-1] ** -0.5) < 1e-9
    )


def tree_attention_forward(
    module: Any,
    query: torch.Tensor,  # [1, H, T, D]: the tree's tokens (root first)
    key: torch.Tensor,  # [1, Hkv, P + T, D]: the layer's cache after appending them
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,  # additive [1, 1, T, P + T] (the fallback's)
    scaling: float,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    args: TreeKernelArgs | None = kwargs.pop(KWARG, None)
    if args is None or query.shape[0] != 1 or not _kernel_applies(module, query):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    from vllm_moa.kernels.tree_attention import tree_attention

    prefix = args.prefix
    assert key.shape[2] == prefix + query.shape[2], "the layer's cache is not prefix + tree"
    pages_k = key[0].transpose(0, 1)[None]  # [1 page, P + T, Hkv, D]: one page, no copy
    pages_v = value[0].transpose(0, 1)[None]
    out = tree_attention(
        query.transpose(1, 2),
        key[:, :, prefix:].transpose(1, 2),
        value[:, :, prefix:].transpose(1, 2),
        args.mask,
        args.num_nodes,
        pages_k,
        pages_v,
        args.page_table,
        args.prefix_lens,
    )
    return out, None  # [1, T, H, D], as HF attention functions return


@contextmanager
def tree_kernel_attention(config: Any) -> Iterator[None]:
    """Route the model's attention layers to `tree_attention_forward` inside the block."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, tree_attention_forward)
    before = config._attn_implementation
    config._attn_implementation = NAME
    try:
        yield
    finally:
        config._attn_implementation = before
