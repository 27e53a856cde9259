"""EAGLE-2 trees with the MoA drafter (one sequence; the search itself is `tree_search`).

Each expanded candidate's SA query sees the verified prefix and its ancestors, its CA query sees
every memory row (< p), and with TLI the target's last layers see their verified cache plus the
root's and the ancestors' draft K/V (within each layer's sliding window, if it has one).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from vllm_moa.decoding.tree_search import NodeKV, TreeSearch
from vllm_moa.model.layers import masked_attention

if TYPE_CHECKING:  # MoAProposer owns a MoATreeDrafter per tree; avoid the import cycle
    from vllm_moa.decoding.moa_proposer import MoAProposer


def rows_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
    """Queries [f, H, D] as the rows of one sequence, over k, v [1, Hkv, S, D] -> [f, H, D]."""
    return masked_attention(q.transpose(0, 1)[None], k, v, mask)[0].transpose(0, 1)


class MoATreeDrafter(TreeSearch):
    """The tree below the proposer's last token (already appended to its tokens, at position
    p = verified_len). Leaves the proposer's caches as they were before except for the root step
    (SA up to p; TLI draft K/V at p): MoAProposer.propose_tree cleans up."""

    def __init__(self, proposer: MoAProposer) -> None:
        super().__init__()
        self.prop = proposer

    def root(self) -> torch.Tensor:
        prop, target = self.prop, self.prop.target
        self.p = prop.verified_len
        logits = prop.draft_logits(self.p)  # SA cache now holds 0..p
        self.sa = NodeKV({0: prop.sa_cache.get(0)})
        tail = range(target.shape.num_layers - prop.tli, target.shape.num_layers)
        self.tail = NodeKV({i: target.cache.get(i) for i in tail})  # verified + root at p
        return logits

    def expand(self, frontier: list[int]) -> torch.Tensor:
        prop, target, p = self.prop, self.prop.target, self.p
        device = target.device
        ids, positions = self.inputs(frontier, p, device)
        emb = target.embed(ids).to(prop.dtype)  # [f, E]
        allowed = self.visible(frontier, p + 1).to(device)  # [f, S]: prefix and ancestors

        def self_attend(q: Tensor, k: Tensor | None, v: Tensor | None) -> Tensor:
            assert k is not None and v is not None
            keys, values = self.sa.update(k.transpose(0, 1)[None], v.transpose(0, 1)[None], 0)
            return rows_attention(q, keys, values, allowed)

        def cross_attend(q: Tensor, *_: Tensor | None) -> Tensor:
            return rows_attention(q, *prop.memory.get(0), None)

        h = prop.drafter.draft_step(emb, positions, self_attend, cross_attend)  # [f, E]
        if prop.tli:
            tail = range(target.shape.num_layers - prop.tli, target.shape.num_layers)
            keys = self.key_positions(p + 1, p).to(device)

            def mask_for(i: int) -> torch.Tensor:  # ancestors, within i's sliding window
                ok = allowed & target.causal_allowed(i, positions, keys)
                return target.additive_mask(ok)[None, None]

            h = target.run_layers(h[None].to(target.dtype), positions, tail, self.tail, mask_for)
            h = target.norm(h)[0]
        return target.lm_logits(h.to(target.dtype))
