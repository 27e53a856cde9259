"""EAGLE-2 dynamic-tree search, whatever the drafter: the bookkeeping shared by every tree drafter.

From the last token (position p) the root step is the chain's first draft step. Then, depth by
depth, the `breadth` best candidates so far (by joint draft log-probability) are expanded
together in one drafter call: each candidate's query sees the verified prefix and its own
ancestors among the expanded candidates (`visible`). The pool of all candidates is then
re-ranked into the `budget` best nodes (`eagle2_tree`). Subclasses say how to run the root step
and how to expand a frontier; nothing they draft outlives the tree.
"""

from __future__ import annotations

import torch

from vllm_moa.decoding.tree import DraftTree, eagle2_tree


class NodeKV:
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


class TreeSearch:
    """One tree per instance. Candidates are numbered in creation order."""

    def __init__(self) -> None:
        self.parent: list[int] = []
        self.token: list[int] = []
        self.score: list[float] = []
        self.depth: list[int] = []
        self.slot: dict[int, int] = {}  # expanded candidate -> its row among the expanded

    def root(self) -> torch.Tensor:
        """Run the root step; drafter logits [V] for the first drafted token."""
        raise NotImplementedError

    def expand(self, frontier: list[int]) -> torch.Tensor:
        """Drafter logits [f, V] after each frontier candidate's token."""
        raise NotImplementedError

    @torch.no_grad()
    def draft(self, depth: int, breadth: int, budget: int) -> DraftTree:
        expanded = self._add([-1], self.root().log_softmax(-1)[None], 1, breadth)
        frontier = list(range(len(self.token)))
        for d in range(2, depth + 1):
            first = len(self.token)
            expanded += self._add(frontier, self.expand(frontier).log_softmax(-1), d, breadth)
            new = range(first, len(self.token))
            frontier = sorted(new, key=lambda c: -self.score[c])[:breadth]
        return eagle2_tree(expanded, breadth, budget)

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
            for t, s in zip(toks, scs, strict=True):
                self.parent.append(parent)
                self.token.append(t)
                self.score.append(s)
                self.depth.append(depth)
            out.append((parent, toks, scs))
        return out

    def inputs(
        self, frontier: list[int], base: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids [f] of the frontier candidates and positions [f] = base + depth."""
        ids = torch.tensor([self.token[c] for c in frontier], device=device)
        positions = torch.tensor([base + self.depth[c] for c in frontier], device=device)
        return ids, positions

    def visible(self, frontier: list[int], prefix_len: int) -> torch.Tensor:
        """bool [f, prefix + expanded]: the whole prefix, then ancestors-or-self (registers the
        frontier as the newest expanded rows)."""
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

    def key_positions(self, prefix_len: int, base: int) -> torch.Tensor:
        """Positions [prefix + expanded] of `visible`'s columns: 0.. for the prefix, then
        base + depth for each expanded candidate, in row order."""
        rows = sorted(self.slot, key=self.slot.__getitem__)
        return torch.tensor([*range(prefix_len), *(base + self.depth[c] for c in rows)])
