"""Draft trees: EAGLE-2 style construction, masks and lossless verification (pure tensors).

A tree of m nodes hangs below the last token the target sampled (the root, not a node). Node i
holds a drafted token, its parent (-1 = the root) and its depth (1 = a child of the root).
Nodes are kept in parent-before-child order, so masks and walks need no sorting.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TreeParams:
    """EAGLE-2 dynamic tree: expand the `breadth` best nodes per depth down to `depth`, then
    verify the `budget` best nodes (the paper: 8, 6, 62)."""

    depth: int = 6
    breadth: int = 8
    budget: int = 62

    def __post_init__(self) -> None:
        for name in ("depth", "breadth", "budget"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"tree {name} must be an int >= 1, got {value!r}")


@dataclass(frozen=True)
class DraftTree:
    tokens: list[int]  # [m] drafted token of each node
    parents: list[int]  # [m] parent node index, -1 for children of the root
    log_probs: list[float]  # [m] joint draft log-probability of the path root -> node

    def __post_init__(self) -> None:
        m = len(self.tokens)
        if not len(self.parents) == len(self.log_probs) == m:
            raise ValueError("tokens, parents and log_probs must have the same length")
        for i, p in enumerate(self.parents):
            if not -1 <= p < i:
                raise ValueError(f"node {i} has parent {p}: parents must come before children")

    @property
    def size(self) -> int:
        return len(self.tokens)

    def depths(self) -> list[int]:
        out: list[int] = []
        for p in self.parents:
            out.append(1 if p < 0 else out[p] + 1)
        return out

    def children(self, node: int) -> list[int]:
        """Children of `node` (-1 = the root), in tree order."""
        return [i for i, p in enumerate(self.parents) if p == node]

    def ancestor_mask(self) -> torch.Tensor:
        """bool [m, m]: node i may attend to node j iff j is i or an ancestor of i."""
        m = self.size
        mask = torch.zeros(m, m, dtype=torch.bool)
        for i, p in enumerate(self.parents):
            mask[i, i] = True
            if p >= 0:
                mask[i] |= mask[p]
        return mask

    def verification_inputs(
        self, root_token: int, position: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The target pass that verifies this tree below `root_token` at `position`: token ids
        [m+1] (root first), positions [m+1] (a node: position + its depth) and bool [m+1, m+1]
        (every node sees the root, itself and its ancestors)."""
        m = self.size
        allowed = torch.zeros(m + 1, m + 1, dtype=torch.bool)
        allowed[:, 0] = True
        allowed[1:, 1:] = self.ancestor_mask()
        positions = torch.tensor([position] + [position + d for d in self.depths()])
        return torch.tensor([root_token, *self.tokens]), positions, allowed


def eagle2_tree(
    expand: list[tuple[int, list[int], list[float]]],
    breadth: int,
    budget: int,
) -> DraftTree:
    """Re-rank expanded candidates into the verified tree (EAGLE-2's final step).

    expand: (parent candidate index or -1, child tokens, child joint log-probs) per expanded
    node, in expansion order (a parent always before its children). Every candidate is kept in
    a pool; the `budget` with the highest joint probability form the tree, plus any ancestor
    they need (a child's joint probability never exceeds its parent's, so ties are the only
    way one could be missing). `breadth` caps the children kept per node.
    """
    tokens: list[int] = []
    parents: list[int] = []
    scores: list[float] = []
    for parent, child_tokens, child_scores in expand:
        order = sorted(range(len(child_tokens)), key=lambda j: -child_scores[j])[:breadth]
        for j in order:
            tokens.append(child_tokens[j])
            parents.append(parent)
            scores.append(child_scores[j])
    chosen = set(sorted(range(len(tokens)), key=lambda i: -scores[i])[:budget])
    for i in list(chosen):
        while parents[i] >= 0 and parents[i] not in chosen:
            chosen.add(parents[i])
            i = parents[i]
    keep = sorted(chosen)  # candidate order is parent-before-child
    remap = {old: new for new, old in enumerate(keep)}
    return DraftTree(
        tokens=[tokens[i] for i in keep],
        parents=[remap[parents[i]] if parents[i] >= 0 else -1 for i in keep],
        log_probs=[scores[i] for i in keep],
    )


@dataclass(frozen=True)
class TreeVerdict:
    path: list[int]  # accepted node indices, root to leaf
    next_token: int  # correction (on rejection) or bonus token


def verify_tree_greedy(tree: DraftTree, target_logits: torch.Tensor) -> TreeVerdict:
    """target_logits [m+1, V]: row 0 after the root, row i+1 after node i. Walk down while a
    child's token is the target's argmax."""
    best = target_logits.argmax(-1).tolist()  # device sync
    node, path = -1, list[int]()
    while True:
        want = best[node + 1]
        nxt = next((c for c in tree.children(node) if tree.tokens[c] == want), None)
        if nxt is None:
            return TreeVerdict(path, want)
        path.append(nxt)
        node = nxt


def verify_tree_sampling(
    tree: DraftTree, target_probs: torch.Tensor, generator: torch.Generator | None
) -> TreeVerdict:
    """Lossless verification of deterministic (e.g. top-k) sibling drafts, as EAGLE/SpecInfer:
    at each node, try its children in order; child x is a point-mass proposal accepted with
    probability p(x) under the current residual p; a rejected x gets p(x) = 0 and p is
    renormalised. If no child is accepted, the token is drawn from the residual; at a leaf, the
    bonus token from the target. target_probs [m+1, V] as in verify_tree_greedy."""
    node, path = -1, list[int]()
    while True:
        p = target_probs[node + 1].clone()
        accepted = None
        for child in tree.children(node):
            x = tree.tokens[child]
            total = p.sum()
            u = torch.rand((), generator=generator, device=p.device)
            if u * total < p[x]:
                accepted = child
                break
            p[x] = 0.0
        if accepted is None:
            token = int(torch.multinomial(p / p.sum(), 1, generator=generator).item())
            return TreeVerdict(path, token)
        path.append(accepted)
        node = accepted
