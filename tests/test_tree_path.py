"""benchmarks/tree_path.py: the chain chosen out of a draft tree for chain-only verifiers."""

import math

from benchmarks.tree_path import best_path
from vllm_moa.decoding.tree import DraftTree


def test_best_path_maximises_expected_accepted_length():
    # root -> a (0.6) -> c (0.6*0.2)      expected length of a,c: 0.6 + 0.12 = 0.72
    #      -> b (0.4) -> d (0.4*0.9)      expected length of b,d: 0.4 + 0.36 = 0.76
    probs = [0.6, 0.4, 0.6 * 0.2, 0.4 * 0.9]
    tree = DraftTree(
        tokens=[10, 11, 12, 13], parents=[-1, -1, 0, 1], log_probs=[math.log(x) for x in probs]
    )
    assert best_path(tree, 2) == [11, 13]  # the greedy first token (10) is not on it
    assert best_path(tree, 1) == [10]  # one token: the most probable
    assert best_path(tree, 2, keep_first=True) == [10, 12]
    chain = DraftTree(tokens=[5, 6, 7], parents=[-1, 0, 1], log_probs=[-0.1, -0.5, -2.0])
    assert best_path(chain, 3) == [5, 6, 7]  # breadth 1: the greedy chain itself
