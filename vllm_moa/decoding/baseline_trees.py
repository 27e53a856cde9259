"""EAGLE-2 trees with the baseline drafters (one sequence; the search itself is `tree_search`).

EAGLE: a candidate at depth d (token at position p + d) is the layer input (its token, its
parent's predicted feature) at position p + d - 1 (the root's children take the root step's
predicted feature); its output is its own predicted feature, from which its children are read.
Independent: a candidate is its token at position p + d, run through every layer.
In both, a candidate's query sees the cached prefix and its ancestors among the expanded.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from vllm_moa.decoding.tree_search import NodeKV, TreeSearch

if TYPE_CHECKING:  # the proposers own one tree drafter per tree; avoid the import cycle
    from vllm_moa.decoding.baseline_proposers import EagleProposer, IndependentProposer


class EagleTreeDrafter(TreeSearch):
    def __init__(self, proposer: EagleProposer, last_token: int) -> None:
        super().__init__()
        self.prop = proposer
        self.last_token = last_token
        self.features: dict[int, torch.Tensor] = {}  # expanded candidate -> predicted feature

    def root(self) -> torch.Tensor:
        prop = self.prop
        self.p, first = len(prop.tokens), prop.cache.length()
        seq = [*prop.tokens, self.last_token]
        # positions first..p-1 with true features (kept in the proposer's cache)
        self.root_feature = prop._step(
            first, seq[first + 1 : self.p + 1], prop.features[first : self.p]
        )
        self.kv = NodeKV({0: prop.cache.get(0)})
        return prop.target.lm_logits(self.root_feature[None].to(prop.target.dtype))[0]

    def expand(self, frontier: list[int]) -> torch.Tensor:
        prop, target, p = self.prop, self.prop.target, self.p
        device = target.device
        ids, positions = self.inputs(frontier, p - 1, device)
        parents = torch.stack([self._parent_feature(c) for c in frontier])
        emb = target.embed(ids).to(prop.dtype)
        x = prop.drafter.fuse(emb[None], parents.to(prop.dtype)[None])  # [1, f, E]
        layer = prop.drafter.layer
        k, v = self.kv.update(*layer.kv_from(x, positions), 0)
        allowed = self.visible(frontier, p).to(device)
        out = layer(x, positions, k, v, allowed)[0]  # [f, E] predicted features
        for r, c in enumerate(frontier):
            self.features[c] = out[r]
        return target.lm_logits(out.to(target.dtype))

    def _parent_feature(self, candidate: int) -> torch.Tensor:
        parent = self.parent[candidate]
        return self.root_feature if parent < 0 else self.features[parent]


class IndependentTreeDrafter(TreeSearch):
    def __init__(self, proposer: IndependentProposer, last_token: int) -> None:
        super().__init__()
        self.prop = proposer
        self.last_token = last_token

    def root(self) -> torch.Tensor:
        prop = self.prop
        seq = [*prop.tokens, self.last_token]
        self.p = len(seq) - 1  # the last token's position; the cache now holds 0..p
        logits = prop._logits(seq)
        self.kv = NodeKV({i: prop.cache.get(i) for i in range(len(prop.drafter.blocks))})
        return logits

    def expand(self, frontier: list[int]) -> torch.Tensor:
        prop, target, p = self.prop, self.prop.target, self.p
        device = target.device
        ids, positions = self.inputs(frontier, p, device)
        allowed = self.visible(frontier, p + 1).to(device)
        h = target.embed(ids)[None].to(prop.drafter.norm.weight.dtype)
        for i, block in enumerate(prop.drafter.blocks):
            k, v = self.kv.update(*block.kv_from(h, positions), i)
            h = block(h, positions, k, v, allowed)
        return target.lm_logits(prop.drafter.norm(h[0]).to(target.dtype))
