"""Where do drafted positions >= 2 lose? Teacher-forced agreement vs engine acceptance.

    python -m benchmarks.positions --target DIR --drafter NAME=DIR [NAME=DIR ...] \
        --prompts HumanEval.jsonl.gz --out benchmarks/results/positions/positions_cpu.json

For each prompt the target's own greedy continuation is generated once. On exactly those
sequences, every drafter is scored teacher-forced at every response position i with stale step
s = 0..K-1 (memory limit i - s: the target information a drafted token at chain position s + 1
has): top-1 agreement with the target. The engine then drafts chains of K on the same prompts;
its conditional acceptance at position s + 1 (accepted at s + 1 / accepted at s) sees the same
tokens (greedy acceptance means every accepted draft is the target's token), the same memory
staleness and the drafter's own computation: if inference matched training, the two agree up to
selection (acceptance is measured only where the earlier positions were accepted). A gap
between them that one method has and another not is a train/inference mismatch to look for.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from benchmarks.testbed.evaluate import read_prompts, run_generations
from benchmarks.testbed.report import add_out_argument, save_json
from vllm_moa.checkpoint import load_drafter
from vllm_moa.decoding import SpeculativeEngine
from vllm_moa.factories.methods import method_for
from vllm_moa.factories.proposers import make_proposer
from vllm_moa.hf_target import HFTarget
from vllm_moa.training.data import Example, collate


@torch.no_grad()
def teacher_forced(method: Any, target: HFTarget, examples: list[Example], k: int) -> list[float]:
    """Agreement per stale step s = 0..k-1 over response positions i >= prompt_len + s."""
    hits, counts = torch.zeros(k), torch.zeros(k)
    for ex in examples:
        batch = collate([ex])
        seq = batch.input_ids.shape[1]
        out_t = target.forward_batch(batch.input_ids, method.hidden_layers)
        want = out_t.logits.argmax(-1)[0].cpu()
        positions = torch.arange(seq)
        for s in range(k):
            scored = (positions >= ex.prompt_len + s) & batch.loss_mask[0]
            limit = torch.where(scored, positions - s, positions)[None]
            out = method.forward(batch, out_t, limit.to(target.device), None)
            if out.valid is not None:
                scored &= out.valid[0].cpu()
            hit = out.logits.argmax(-1)[0].cpu() == want
            hits[s] += hit[scored].sum()
            counts[s] += scored.sum()
    return (hits / counts.clamp_min(1)).tolist()


def greedy_examples(
    target: HFTarget, tokenizer: Any, prompts_path: Path, num_prompts: int, max_tokens: int
) -> tuple[list[list[int]], dict[str, Any], list[Example]]:
    """The prompts (token ids, left-truncated to fit), the target's plain greedy run on them, and
    prompt + continuation as examples scored on the continuation: the text the engine sees."""
    budget = target.max_length - max_tokens - 1
    prompts = [tokenizer(t)["input_ids"][-budget:] for t in read_prompts(prompts_path, num_prompts)]
    plain = run_generations(
        SpeculativeEngine(target), prompts, max_tokens, 1, [tokenizer.eos_token_id]
    )
    examples = [
        Example(p + o, [False] * len(p) + [True] * len(o), len(p))
        for p, o in zip(prompts, plain["outputs"], strict=True)
    ]
    return prompts, plain, examples


def conditional(per_position: list[float]) -> list[float]:
    """P(accepted at j | accepted at j - 1) from unconditional per-position acceptance."""
    out, prev = [], 1.0
    for a in per_position:
        out.append(a / prev if prev else 0.0)
        prev = a
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", type=Path, required=True)
    p.add_argument("--drafter", nargs="+", required=True, help="NAME=DIR")
    p.add_argument("--prompts", type=Path, required=True)
    add_out_argument(p, "positions", type=Path)
    p.add_argument("--num-prompts", type=int, default=20)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--k", type=int, default=4)
    args = p.parse_args(argv)

    from transformers import AutoTokenizer

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    target = HFTarget.from_pretrained(args.target)
    eos = [tokenizer.eos_token_id]
    prompts, plain, examples = greedy_examples(
        target, tokenizer, args.prompts, args.num_prompts, args.max_tokens
    )
    figures: dict[str, Any] = {}
    for spec in args.drafter:
        name, _, path = spec.partition("=")
        drafter = load_drafter(path, target.shape)
        drafter.eval()
        method = method_for(drafter, target)  # no feature noise: eval
        agreement = teacher_forced(method, target, examples, args.k)
        engine = SpeculativeEngine(target, make_proposer(drafter, target))
        run = run_generations(engine, prompts, args.max_tokens, args.k, eos)
        per_pos = run["acceptance_rate_per_position"]
        figures[name] = {
            "teacher_forced_agreement_per_stale_step": agreement,
            "engine_acceptance_per_position": per_pos,
            "engine_conditional_acceptance": conditional(per_pos),
            "tau": run["tau"],
            "lossless": run["outputs"] == plain["outputs"],
        }
        print(name, json.dumps({k: v for k, v in figures[name].items()}, default=str))
    config = {
        "target": str(args.target),
        "drafters": args.drafter,
        "prompts": str(args.prompts),
        "num_prompts": args.num_prompts,
        "max_tokens": args.max_tokens,
        "k": args.k,
    }
    save_json(args.out, "positions", {"config": config, "figures": figures})
    plot(args.out.with_suffix(".png"), figures, args.k)
    return 0


def plot(path: Path, figures: dict[str, Any], k: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    steps = list(range(1, k + 1))
    for i, (name, f) in enumerate(figures.items()):
        color = f"C{i}"
        ax.plot(steps, f["teacher_forced_agreement_per_stale_step"], "-o", color=color, label=name)
        ax.plot(steps, f["engine_conditional_acceptance"], "--x", color=color)
    ax.set_xlabel("draft position (stale steps + 1)")
    ax.set_ylabel("top-1 agreement / conditional acceptance")
    ax.set_title("solid: teacher-forced on target greedy text; dashed: engine (chain)")
    ax.set_xticks(steps)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
