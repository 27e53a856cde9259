"""EAGLE-2 dynamic-tree drafting with the MoA drafter (one sequence).

From the last token (position p) the root step is the chain's first draft step. Then, depth by
depth, the `breadth` best candidates so far (by joint draft log-probability) are expanded
together: each one's SA query sees the verified prefix and its own ancestors among the expanded
nodes, its CA query sees every memory row (< p), and with TLI the target's last layers see their
verified cache plus the root's and the ancestors' draft K/V. The pool of all candidates is then
re-ranked into the `budget` best nodes (`eagle2_tree`). Nothing drafted is kept afterwards.
"""

from __future__ import annotations

import torch

from vllm_moa.decoding.moa_proposer import MoAProposer
from vllm_moa.decoding.tree import DraftTree, eagle2_tree


class _NodeKV:
    """A cache whose update() returns [fixed prefix | the nodes so far | the new ones]."""

    def __init__(self, prefix: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.prefix = prefix  # layer -> (K, V) [1, Hkv, S, D]
        self.nodes: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def update(
        self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args: object, **kw: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if layer_idx in self.nodes:
            k0, v0 = self.nodes[layer_idx]
            key, value = torch.cat([k0, key], dim=2), torch.cat([v0, value], dim=2)
        self.nodes[layer_idx] = (key, value)
        pk, pv = self.prefix[layer_idx]
        return torch.cat([pk, key], dim=2), torch.cat([pv, value], dim=2)


class MoATreeDrafter:
    """Builds one draft tree per cycle on top of a MoAProposer's state."""

    def __init__(self, proposer: MoAProposer) -> None:
        self.p = proposer

    @torch.no_grad()
    def draft(self, last_token: int, depth: int, breadth: int, budget: int) -> DraftTree:
        prop, target = self.p, self.p.target
        p = prop.verified_len
        prop.tokens.append(last_token)
        root = prop.draft_logits(p).log_softmax(-1)  # SA cache now holds 0..p
        sa_k, sa_v = prop.sa_cache.get(0)
        self.sa = _NodeKV({0: (sa_k, sa_v)})
        tail = range(target.shape.num_layers - prop.tli, target.shape.num_layers)
        self.tail = _NodeKV({i: target.cache.get(i) for i in tail})  # verified + root at p
        self.parent: list[int] = []
        self.token: list[int] = []
        self.score: list[float] = []
        self.depth: list[int] = []
        self.slot: dict[int, int] = {}  # expanded candidate -> its row among the expanded
        expand = [self._add(-1, root, 0.0, 1, breadth)]
        frontier = list(range(len(self.token)))
        for d in range(2, depth + 1):
            logits = self._expand(frontier, p)
            new: list[int] = []
            for row, cand in enumerate(frontier):
                first = len(self.token)
                expand.append(
                    self._add(cand, logits[row].log_softmax(-1), self.score[cand], d, breadth)
                )
                new += range(first, len(self.token))
            frontier = sorted(new, key=lambda c: -self.score[c])[:breadth]
        del prop.tokens[p:]
        prop.sa_cache.crop(p + 1)
        if prop.tli:
            target.crop(p)
        prop._last_token = last_token
        return eagle2_tree(expand, breadth, budget)

    def _add(
        self, parent: int, logp: torch.Tensor, base: float, depth: int, breadth: int
    ) -> tuple[int, list[int], list[float]]:
        top = logp.topk(min(breadth, logp.shape[-1]))
        tokens, scores = top.indices.tolist(), (top.values + base).tolist()  # device sync
        for t, s in zip(tokens, scores, strict=True):
            self.parent.append(parent)
            self.token.append(t)
            self.score.append(s)
            self.depth.append(depth)
        return parent, tokens, scores

    def _visible(self, frontier: list[int], prefix_len: int) -> torch.Tensor:
        """bool [f, prefix + expanded]: the whole prefix, then ancestors-or-self."""
        first = len(self.slot)
        for r, c in enumerate(frontier):
            self.slot[c] = first + r
        allowed = torch.zeros(len(frontier), prefix_len + len(self.slot), dtype=torch.bool)
        allowed[:, :prefix_len] = True
        for r, c in enumerate(frontier):
            a = c
            while a >= 0:
                allowed[r, prefix_len + self.slot[a]] = True
                a = self.parent[a]
        return allowed

    def _expand(self, frontier: list[int], p: int) -> torch.Tensor:
        """Drafter logits [f, V] after each frontier candidate's token."""
        prop, target = self.p, self.p.target
        device = target.device
        ids = torch.tensor([self.token[c] for c in frontier], device=device)
        positions = torch.tensor([p + self.depth[c] for c in frontier], device=device)
        sa = prop.drafter.self_attention
        emb = target.embed(ids).to(prop.dtype)[None]
        k, v = self.sa.update(*sa.kv_from(emb, positions), 0)
        allowed = self._visible(frontier, p + 1).to(device)
        h = sa(emb, positions, k, v, allowed)
        mem_k, mem_v = prop.memory.get(0)
        h = prop.drafter.cross_attention(h, positions, mem_k, mem_v, None)[0]  # [f, E]
        if prop.tli:
            tail = range(target.shape.num_layers - prop.tli, target.shape.num_layers)
            mask = target.additive_mask(allowed)[None, None]
            h = target.run_layers(
                h[None].to(target.dtype), positions, tail, self.tail, lambda i: mask
            )
            h = target.norm(h)[0]
        return target.lm_logits(h.to(target.dtype))
