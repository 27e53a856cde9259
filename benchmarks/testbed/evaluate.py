"""Evaluate drafters with the standalone engine on held-out prompts (greedy, chains of K)."""

from __future__ import annotations

import gzip
import json
from collections.abc import Callable
from itertools import islice
from pathlib import Path
from typing import Any

from tqdm import tqdm

from vllm_moa.checkpoint import load_drafter
from vllm_moa.decoding import SpeculativeEngine
from vllm_moa.decoding.proposer import TreeProposer
from vllm_moa.decoding.tree import TreeParams
from vllm_moa.factories.proposers import make_proposer
from vllm_moa.hf_target import HFTarget


def read_prompts(path: Path, limit: int, skip: int = 0) -> list[str]:
    """`prompt` (HumanEval) or the first of `turns` (the paper's 6-task set) of each record:
    `limit` of them after the first `skip`."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        lines = islice((line for line in f if line.strip()), skip, skip + limit)
        records = [json.loads(line) for line in lines]
    return [r["prompt"] if "prompt" in r else r["turns"][0] for r in records]


def run_generations(
    engine: SpeculativeEngine,
    prompts: list[list[int]],
    new_tokens: int,
    k: int,
    eos: list[int],
    tree: TreeParams | None = None,
) -> dict[str, Any]:
    """Greedy generations; k is the chain length, or the tree's depth when `tree` is given.
    Always the fixed k (adaptive speculation off): the testbed measures the drafter at k."""
    cycles = accepted = calls = tokens = 0
    seconds = 0.0
    hist = [0] * (k + 1)
    drafted_at = [0] * k
    accepted_at = [0] * k
    outputs = []
    for ids in prompts:
        r = engine.generate(
            ids, new_tokens, num_speculative_tokens=k, eos_token_ids=eos, tree=tree, adaptive=False
        )
        s = r.stats
        outputs.append(r.token_ids)
        cycles += s.num_cycles
        accepted += s.num_accepted_tokens
        calls += s.num_target_calls
        tokens += s.num_generated_tokens
        seconds += s.wall_time_s
        for a, n in enumerate(s.accepted_length_histogram):
            hist[a] += n
        for i in range(min(k, len(s.drafted_per_position))):
            drafted_at[i] += s.drafted_per_position[i]
            accepted_at[i] += s.accepted_per_position[i]
    return {
        "tau": 1 + accepted / max(1, cycles),
        "accepted_length_histogram": hist,
        "acceptance_rate_per_position": [
            a / d if d else 0.0 for a, d in zip(accepted_at, drafted_at, strict=True)
        ],
        "target_calls_per_token": calls / max(1, tokens),
        "tokens_per_second": tokens / seconds if seconds else 0.0,
        "generated_tokens": tokens,
        "outputs": outputs,
    }


def heldout_loss(target: HFTarget, prompts: list[list[int]]) -> float:
    """The target's mean next-token loss (nats per token) over the prompts' own tokens: how well
    trained it is on held-out text (pretraining reports its last batch's loss, a noisy figure)."""
    import torch

    total, count = torch.zeros((), device=target.device), 0
    with torch.no_grad():
        for ids in (ids for ids in prompts if len(ids) > 1):  # one token predicts nothing
            x = torch.tensor([ids], device=target.device)
            total += target.model(input_ids=x, labels=x).loss * (len(ids) - 1)  # HF: mean
            count += len(ids) - 1
    return total.item() / max(1, count)  # one device sync


def evaluate_all(
    target_dir: Path,
    drafter_dirs: dict[str, Path],
    prompt_texts: list[str],
    new_tokens: int,
    ks: tuple[int, ...],
    tree: TreeParams | None = None,
    device: str = "cpu",
    on_method: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Plain decoding, then every drafter's chains (and trees): fp32 on `device`. `on_method`
    sees the results so far after each drafter (for partial reports)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    target = HFTarget.from_pretrained(target_dir, device=device)
    budget = target.max_length - new_tokens - 1
    prompts = [tokenizer(p)["input_ids"][-budget:] for p in prompt_texts]
    eos = [tokenizer.eos_token_id]
    plain = run_generations(SpeculativeEngine(target), prompts, new_tokens, 1, eos)
    results: dict[str, Any] = {"plain": {k: v for k, v in plain.items() if k != "outputs"}}
    results["plain"]["target_heldout_loss"] = heldout_loss(target, prompts)

    def against_plain(r: dict[str, Any]) -> dict[str, Any]:
        r["lossless"] = r.pop("outputs") == plain["outputs"]
        r["speedup_vs_plain"] = r["tokens_per_second"] / plain["tokens_per_second"]
        return r

    for name, path in tqdm(drafter_dirs.items(), desc="evaluate"):
        engine = SpeculativeEngine(
            target, make_proposer(load_drafter(path, target.shape, device=device), target)
        )
        results[name] = {}
        for k in ks:
            r = run_generations(engine, prompts, new_tokens, k, eos)
            results[name][f"k{k}"] = against_plain(r)
        if tree is not None and isinstance(engine.proposer, TreeProposer):
            r = run_generations(engine, prompts, new_tokens, tree.depth, eos, tree)
            results[name][f"tree_d{tree.depth}_b{tree.breadth}_m{tree.budget}"] = against_plain(r)
        if on_method is not None:
            on_method(results)
    return results
