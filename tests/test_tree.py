"""Draft trees: masks by hand, EAGLE-2 re-ranking, greedy and lossless tree verification."""

import pytest
import torch
from scipy.stats import chi2

from vllm_moa.decoding.tree import (
    DraftTree,
    TreeVerdict,
    eagle2_tree,
    verify_tree_greedy,
    verify_tree_sampling,
)

T, F = True, False
# root -> a(0), b(1); a -> c(2), d(3); c -> e(4)
TREE = DraftTree(
    tokens=[5, 6, 7, 8, 9], parents=[-1, -1, 0, 0, 2], log_probs=[-0.1, -0.5, -0.3, -0.9, -0.6]
)


def test_ancestor_mask_and_depths_by_hand():
    expected = torch.tensor(
        [
            [T, F, F, F, F],
            [F, T, F, F, F],
            [T, F, T, F, F],
            [T, F, F, T, F],
            [T, F, T, F, T],
        ]
    )
    assert torch.equal(TREE.ancestor_mask(), expected)
    assert TREE.depths() == [1, 1, 2, 2, 3]
    assert TREE.children(-1) == [0, 1] and TREE.children(0) == [2, 3]


def test_tree_validation():
    with pytest.raises(ValueError, match="parents must come before children"):
        DraftTree(tokens=[1, 2], parents=[1, -1], log_probs=[0.0, 0.0])


def test_eagle2_rerank_keeps_the_best_and_their_ancestors():
    expand = [
        (-1, [10, 11, 12], [-0.1, -1.0, -2.0]),  # root's children -> candidates 0, 1 (breadth 2)
        (0, [20, 21], [-0.2, -0.4]),  # children of candidate 0 -> candidates 2, 3
        (2, [30], [-0.3]),  # child of candidate 2 -> candidate 4
    ]
    tree = eagle2_tree(expand, breadth=2, budget=3)
    assert tree.tokens == [10, 20, 30] and tree.parents == [-1, 0, 1]
    tree = eagle2_tree(expand, breadth=2, budget=5)
    assert tree.tokens == [10, 11, 20, 21, 30] and tree.parents == [-1, -1, 0, 0, 2]


def test_greedy_tree_walk():
    logits = torch.full((6, 12), -5.0)
    for row, tok in enumerate([5, 8, 0, 1, 2, 3]):  # root->5 (a), a->8 (d), row of d -> 2
        logits[row, tok] = 5.0
    assert verify_tree_greedy(TREE, logits) == TreeVerdict(path=[0, 3], next_token=2)
    logits[0] = -5.0
    logits[0, 4] = 5.0  # nothing matches at the root
    assert verify_tree_greedy(TREE, logits) == TreeVerdict(path=[], next_token=4)


def _broken(tree, probs, generator):
    """A broken verifier: does not remove rejected siblings from the residual."""
    node, path = -1, []
    while True:
        p = probs[node + 1]
        for child in tree.children(node):
            if torch.rand((), generator=generator) < p[tree.tokens[child]]:
                path.append(child)
                node = child
                break
        else:
            return TreeVerdict(path, int(torch.multinomial(p, 1, generator=generator)))


@pytest.mark.parametrize("verifier, lossless", [(verify_tree_sampling, True), (_broken, False)])
def test_tree_sampling_preserves_the_target_distribution(verifier, lossless):
    """Context-free target (same law at every node): the first two emitted tokens must be
    i.i.d. from it, whatever the tree drafted."""
    vocab = 4
    law = torch.tensor([0.1, 0.2, 0.3, 0.4])
    tree = DraftTree(tokens=[3, 2, 1, 3, 0], parents=[-1, -1, 0, 0, 1], log_probs=[0.0] * 5)
    probs = law.expand(tree.size + 1, vocab)
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(vocab * vocab)
    for _ in range(6000):
        v = verifier(tree, probs, g)
        emitted = [tree.tokens[i] for i in v.path] + [v.next_token]
        if len(emitted) < 2:  # continue from the correction token with the same law
            emitted.append(int(torch.multinomial(law, 1, generator=g)))
        counts[emitted[0] * vocab + emitted[1]] += 1
    expected = torch.outer(law, law).flatten() * counts.sum()
    pvalue = chi2.sf(float(((counts - expected) ** 2 / expected).sum()), vocab * vocab - 1)
    assert (pvalue > 1e-3) == lossless, pvalue
