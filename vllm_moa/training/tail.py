"""TLI in training, aligned with inference token by token.

At inference, a drafted position i of the cycle starting at c runs the target's last N layers
with the target's true K/V for positions < c and the drafter's own (draft) K/V for c..i. The
release approximates this by feeding the true hidden state at cycle starts. Here every query gets
exactly its inference context: the keys of each tail layer are [true K/V of the target | K/V of
the predicted stream], and the mask lets query i see true keys j < c(i) and predicted keys
c(i) <= j <= i.
"""

from __future__ import annotations

import torch

from vllm_moa.hf_target.adapter import HFTarget, split_kv


class PrefixKV:
    """A cache whose update() prepends fixed per-layer keys/values and stores nothing."""

    def __init__(self, prefix: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.prefix = prefix  # layer -> (K, V), each [B, Hkv, T, D]

    def update(
        self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args: object, **kw: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        k0, v0 = self.prefix[layer_idx]
        return torch.cat([k0, key.to(k0.dtype)], dim=2), torch.cat([v0, value.to(v0.dtype)], dim=2)


def aligned_tail_mask(target: HFTarget, layer_idx: int, memory_limit: torch.Tensor) -> torch.Tensor:
    """Additive [B, 1, T, 2T]: query i sees true keys j < limit[i], predicted keys limit[i]..i."""
    seq = memory_limit.shape[-1]
    pos = torch.arange(seq, device=memory_limit.device)
    causal = target.causal_allowed(layer_idx, pos, pos)[None]  # [1, T, T]
    limit = memory_limit[:, :, None]  # [B, T, 1]
    true_keys = causal & (pos[None, None, :] < limit)
    predicted_keys = causal & (pos[None, None, :] >= limit)
    return target.additive_mask(torch.cat([true_keys, predicted_keys], dim=-1))[:, None]


def run_aligned_tail(
    target: HFTarget,
    predicted: torch.Tensor,  # [B, T, E]: the drafter's o^(L+1-N) at every position
    layer_kv: torch.Tensor,  # [B, T, L, 2*E_kv]: the target's true K|V
    memory_limit: torch.Tensor,  # [B, T]: the cycle start of each query
    num_layers: int,
) -> torch.Tensor:
    """The target's last `num_layers` layers + final norm -> [B, T, E], differentiable in
    `predicted` (the target's weights stay frozen)."""
    total = target.shape.num_layers
    layer_ids = range(total - num_layers, total)
    prefix = {i: split_kv(layer_kv[:, :, i], target.shape.num_kv_heads) for i in layer_ids}
    masks = {i: aligned_tail_mask(target, i, memory_limit) for i in layer_ids}
    positions = torch.arange(predicted.shape[1], device=predicted.device)
    h = target.run_layers(
        predicted.to(target.dtype), positions, layer_ids, PrefixKV(prefix), masks.__getitem__
    )
    return target.norm(h)
