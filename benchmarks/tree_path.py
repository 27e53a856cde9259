"""Does a drafter-side tree search raise tau when only a chain can be verified (vLLM 0.32)?

    python -m benchmarks.tree_path --target DIR --drafter DIR --prompts HumanEval.jsonl.gz \
        --out benchmarks/results/tree_path/tree_path_cpu.json

For each cycle the MoA drafter builds an EAGLE-2 tree (depth K, breadth W, every expanded node
kept) and submits one root-to-node path as the chain: the one with the largest expected
accepted length under the drafter's own probabilities, sum over its nodes of the joint draft
probability of the path down to that node (and, as a variant, the best such path through the
greedy first token). W=1 is the greedy chain. Standalone engine, greedy
(outputs checked equal to plain decoding), same prompts for every W; tau = 1 + accepted / cycles.
This measures the idea without wiring it into vLLM: if it does not pay here, it does not there.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import torch

from vllm_moa.decoding.proposer import DraftProposal
from vllm_moa.decoding.tree import DraftTree
from vllm_moa.drafters.moa.proposer import MoAProposer


def best_path(tree: DraftTree, max_len: int, keep_first: bool = False) -> list[int]:
    """Tokens of the path (length <= max_len) maximising the sum of exp(joint log-prob) over
    its nodes: the drafter's own estimate of the expected accepted length. `keep_first`: only
    paths through the root's most probable child (the greedy chain's first token)."""
    value: list[float] = []
    top: list[int] = []  # each node's depth-1 ancestor
    for i, (parent, logp) in enumerate(zip(tree.parents, tree.log_probs, strict=True)):
        value.append((value[parent] if parent >= 0 else 0.0) + math.exp(logp))
        top.append(i if parent < 0 else top[parent])
    depths = tree.depths()
    first = max(tree.children(-1), key=lambda c: tree.log_probs[c])
    candidates = [
        i for i in range(tree.size) if depths[i] <= max_len and (not keep_first or top[i] == first)
    ]
    node = max(candidates, key=value.__getitem__)
    path = []
    while node >= 0:
        path.append(tree.tokens[node])
        node = tree.parents[node]
    return path[::-1]


class PathProposer:
    """Wraps a MoAProposer: propose() drafts a tree and returns its best path as the chain."""

    def __init__(self, inner: MoAProposer, breadth: int, keep_first: bool) -> None:
        self.inner, self.breadth, self.keep_first = inner, breadth, keep_first

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def propose(
        self, last_token: int, num_tokens: int, params: Any, gen: Any, forced: Any = ()
    ) -> DraftProposal:
        if self.breadth == 1 or forced:
            return self.inner.propose(last_token, num_tokens, params, gen, forced)
        budget = self.breadth + (num_tokens - 1) * self.breadth**2  # every node drafted
        tree = self.inner.propose_tree(last_token, num_tokens, self.breadth, budget)
        tokens = best_path(tree, num_tokens, self.keep_first)
        logits = torch.zeros(len(tokens), self.inner.target.shape.vocab_size)
        return DraftProposal(tokens=tokens, logits=logits, probs=None)


def main() -> None:
    from transformers import AutoTokenizer

    from benchmarks.testbed.evaluate import read_prompts, run_generations
    from benchmarks.testbed.report import add_out_argument, save_json
    from vllm_moa.checkpoint import load_drafter
    from vllm_moa.checkpoint.io import drafter_dir_of
    from vllm_moa.decoding import SpeculativeEngine
    from vllm_moa.drafters.moa.model import MoADrafter
    from vllm_moa.hf_target import HFTarget

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", required=True)
    p.add_argument("--drafter", required=True, help="MoA drafter (or its `train --out` dir)")
    p.add_argument("--prompts", required=True)
    add_out_argument(p, "tree_path")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--breadths", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--num-prompts", type=int, default=20)
    p.add_argument("--max-tokens", type=int, default=64)
    args = p.parse_args()

    drafter_dir = drafter_dir_of(args.drafter)
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    target = HFTarget.from_pretrained(args.target)
    budget = target.max_length - args.max_tokens - 1  # as the testbed does
    texts = read_prompts(Path(args.prompts), args.num_prompts)
    prompts = [tokenizer(t)["input_ids"][-budget:] for t in texts]
    eos = [tokenizer.eos_token_id]
    plain = run_generations(SpeculativeEngine(target), prompts, args.max_tokens, 1, eos)
    drafter = load_drafter(drafter_dir, target.shape)
    if not isinstance(drafter, MoADrafter):
        p.error(f"{drafter_dir} holds a {type(drafter).__name__}; the path search drafts with MoA")
    rows = []
    runs = [(w, keep) for w in args.breadths for keep in ([False] if w == 1 else [False, True])]
    for breadth, keep_first in runs:
        proposer = PathProposer(MoAProposer(drafter, target), breadth, keep_first)
        engine = SpeculativeEngine(target, proposer)
        r = run_generations(engine, prompts, args.max_tokens, args.k, eos)
        row = {
            "breadth": breadth,
            "keep_greedy_first": keep_first,
            "k": args.k,
            "tau": r["tau"],
            "acceptance_rate_per_position": r["acceptance_rate_per_position"],
            "tokens_per_second": r["tokens_per_second"],
            "lossless": r["outputs"] == plain["outputs"],
        }
        rows.append(row)
        print(json.dumps(row))
    save_json(Path(args.out), "tree_path", {"config": vars(args), "results": rows})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
