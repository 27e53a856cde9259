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

# The speculative machinery at a known K, drafting every cycle (test_adaptive.py: the rule).
pytestmark = pytest.mark.fixed_k

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


# ---- end to end: the engine with MoA trees ----
from conftest import make_drafter, make_hf_model  # noqa: E402

from vllm_moa.decoding import SamplingParams, SpeculativeEngine  # noqa: E402
from vllm_moa.decoding.tree import TreeParams  # noqa: E402
from vllm_moa.drafters.moa.proposer import MoAProposer  # noqa: E402
from vllm_moa.hf_target import HFTarget  # noqa: E402


def test_forward_tree_with_a_chain_equals_forward():
    t = HFTarget(make_hf_model(seed=2))
    ids = torch.arange(1, 15)
    t.reset()
    t.forward(ids[:8])
    n = len(ids) - 8
    chain = torch.tril(torch.ones(n, n, dtype=torch.bool))
    out = t.forward_tree(ids[8:], torch.arange(8, 8 + n), chain)
    t.reset()
    full = t.forward(ids)
    torch.testing.assert_close(out.logits, full.logits[8:], atol=2e-5, rtol=1e-4)


def test_cache_keep_compacts_the_accepted_path():
    t = HFTarget(make_hf_model(seed=2))
    ids = torch.tensor([3, 4, 5, 6, 7, 8])
    t.reset()
    t.forward(ids[:3])
    # root token 6 at position 3; nodes: 7 (child of root), 99 (sibling), 8 (child of 7)
    allowed = torch.tensor(
        [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool
    )
    t.forward_tree(torch.tensor([6, 7, 99, 8]), torch.tensor([3, 4, 4, 5]), allowed)
    t.cache.keep(3, [3, 4, 6])  # root, node 7, node 8
    assert t.seq_len == 6
    after = t.forward(torch.tensor([1]))
    t.reset()
    ref = t.forward(torch.tensor([3, 4, 5, 6, 7, 8, 1]))
    torch.testing.assert_close(after.logits, ref.logits[-1:], atol=2e-5, rtol=1e-4)


@pytest.fixture(scope="module")
def small_target():
    return HFTarget(make_hf_model(vocab_size=12, seed=11))


@pytest.mark.parametrize("tli", [0, 1])
@pytest.mark.parametrize("tree", [TreeParams(3, 2, 5), TreeParams(4, 4, 12), TreeParams(6, 8, 62)])
def test_tree_greedy_equality(small_target, tli, tree):
    proposer = MoAProposer(make_drafter(small_target, tli=tli, seed=tli), small_target)
    engine = SpeculativeEngine(small_target, proposer)
    accepted = 0
    for prompt in ([1, 5, 3], [7] * 9, list(range(12)) * 2):
        plain = SpeculativeEngine(small_target).generate(prompt, 30).token_ids
        result = engine.generate(prompt, 30, tree=tree)
        assert result.token_ids == plain
        accepted += result.stats.num_accepted_tokens
    assert accepted > 0


def test_tree_needs_a_moa_drafter(small_target):
    with pytest.raises(ValueError, match="tree decoding needs a drafter that drafts trees"):
        SpeculativeEngine(small_target).generate([1, 2], 5, tree=TreeParams())
    with pytest.raises(ValueError, match="tree breadth must be an int >= 1"):
        TreeParams(breadth=0)


@pytest.mark.slow
@pytest.mark.parametrize("lossless", [True, False])
def test_engine_tree_sampling_preserves_the_target_distribution(monkeypatch, lossless):
    """Tokens 2..4 of speculative tree sampling follow the exact target law (vocab 4), and a
    broken sibling verifier is caught."""
    import test_sampling as ts

    import vllm_moa.decoding.engine as engine_module

    target = HFTarget(
        make_hf_model(
            vocab_size=4, hidden_size=64, num_heads=1, num_layers=2, seed=6, logit_scale=8.0
        )
    )
    if not lossless:
        monkeypatch.setattr(engine_module, "verify_tree_sampling", _broken)
    params = SamplingParams(temperature=1.0)
    marginal = ts._exact_joint(target, params).sum(0).flatten()
    engine = SpeculativeEngine(target, MoAProposer(make_drafter(target, tli=1, seed=1), target))
    counts = torch.zeros(64)
    for seed in range(1500):
        r = engine.generate(ts.PROMPT, ts.NEW, params, seed=seed, tree=TreeParams(3, 2, 4))
        a, b, c = r.token_ids[1:]
        counts[(a * 4 + b) * 4 + c] += 1
    assert (ts._chi2_pvalue(counts, marginal) > 1e-3) == lossless
