"""EAGLE-2 trees with the MoA drafter (one sequence; the search itself is `tree_search`).

Each expanded candidate's SA query sees the verified prefix and its ancestors, its CA query sees
every memory row (< p), and with TLI the target's last layers see their verified cache plus the
root's and the ancestors' draft K/V (within each layer's sliding window, if it has one).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from vllm_moa.decoding.tree_search import NodeKV, TreeSearch

if TYPE_CHECKING:  # MoAProposer owns a MoATreeDrafter per tree; avoid the import cycle
    from vllm_moa.decoding.moa_proposer import MoAProposer


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
        sa = prop.drafter.self_attention
        emb = target.embed(ids).to(prop.dtype)[None]
        k, v = self.sa.update(*sa.kv_from(emb, positions), 0)
        allowed = self.visible(frontier, p + 1).to(device)
        h = sa(emb, positions, k, v, allowed)
        mem_k, mem_v = prop.memory.get(0)
        h = prop.drafter.cross_attention(h, positions, mem_k, mem_v, None)[0]  # [f, E]
        if prop.tli:
            tail = range(target.shape.num_layers - prop.tli, target.shape.num_layers)
            keys = self.key_positions(p + 1, p).to(device)

            def mask_for(i: int) -> torch.Tensor:  # ancestors, within i's sliding window
                ok = allowed & target.causal_allowed(i, positions, keys)
                return target.additive_mask(ok)[None, None]

            h = target.run_layers(h[None].to(target.dtype), positions, tail, self.tail, mask_for)
            h = target.norm(h)[0]
        return target.lm_logits(h.to(target.dtype))
