"""EAGLE-2 dynamic-tree drafting with the MoA drafter (one sequence).

From the last token (position p) the root step is the chain's first draft step. Then, depth by
depth, the `breadth` best candidates so far (by joint draft log-probability) are expanded
together: each one's SA query sees the verified prefix and its own ancestors among the expanded
nodes, its CA query sees every memory row (< p), and with TLI the target's last layers see their
verified cache plus the root's and the ancestors' draft K/V. The pool of all candidates is then
re-ranked into the `budget` best nodes (`eagle2_tree`). Nothing drafted is kept afterwards.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from vllm_moa.decoding.tree import DraftTree, eagle2_tree

if TYPE_CHECKING:  # MoAProposer owns a MoATreeDrafter per tree; avoid the import cycle
    from vllm_moa.decoding.moa_proposer import MoAProposer


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
    def draft(self, depth: int, breadth: int, budget: int) -> DraftTree:
        """The tree below the proposer's last token (already appended to its tokens, at
        position p = verified_len). Leaves the proposer's caches as they were before except
        for the root step (SA up to p; TLI draft K/V at p): MoAProposer.propose_tree cleans up."""
        prop, target = self.p, self.p.target
        p = prop.verified_len
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
        expand = self._add([-1], root[None], 1, breadth)
        frontier = list(range(len(self.token)))
        for d in range(2, depth + 1):
            first = len(self.token)
            expand += self._add(frontier, self._expand(frontier, p).log_softmax(-1), d, breadth)
            new = range(first, len(self.token))
            frontier = sorted(new, key=lambda c: -self.score[c])[:breadth]
        return eagle2_tree(expand, breadth, budget)

    def _add(
        self, parents: list[int], logp: torch.Tensor, depth: int, breadth: int
    ) -> list[tuple[int, list[int], list[float]]]:
        """Top-`breadth` children of each parent (rows of logp [f, V]) into the pool."""
        top = logp.topk(min(breadth, logp.shape[-1]), dim=-1)
        base = torch.tensor([self.score[c] if c >= 0 else 0.0 for c in parents])
        tokens = top.indices.tolist()  # device syncs: once per depth, not per node
        scores = (top.values.float().cpu() + base[:, None]).tolist()
        out = []
        for parent, toks, scs in zip(parents, tokens, scores, strict=True):
            self._append(parent, toks, scs, depth)
            out.append((parent, toks, scs))
        return out

    def _append(self, parent: int, tokens: list[int], scores: list[float], depth: int) -> None:
        for t, s in zip(tokens, scores, strict=True):
            self.parent.append(parent)
            self.token.append(t)
            self.score.append(s)
            self.depth.append(depth)

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
