"""`vllm-moa generate --hierarchy` and `vllm-moa hsd-plan`: hierarchical speculative decoding
from the command line (vllm_moa/hsd/: hierarchy.py, plan.py, measure.py; docs/hsd.md)."""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path
from typing import Any

DEFAULT_BUFFER = 4  # `generate --hierarchy` without --buffers: T of every level


def hierarchy_args(args: argparse.Namespace) -> tuple[list[str] | None, list[int] | None]:
    """--hierarchy LEVELS and --buffers T0,T1,..., checked against the other flags."""
    from vllm_moa.factories.proposers import parse_levels

    if args.hierarchy is None:
        if args.buffers is not None:
            raise ValueError("--buffers needs --hierarchy (the levels they belong to)")
        return None, None
    if args.drafter is not None:
        raise ValueError("give either --drafter (one drafter) or --hierarchy (a stack), not both")
    if any(x is not None for x in (args.tree_depth, args.tree_breadth, args.tree_tokens)):
        raise ValueError("--tree-* options draft trees with one drafter; --hierarchy runs chains")
    levels = parse_levels(args.hierarchy)
    if args.buffers is None:
        return levels, None
    try:
        sizes = [int(t) for t in args.buffers.split(",")]
    except ValueError:
        raise ValueError(
            f"--buffers {args.buffers!r} must be integers >= 1, comma-separated (e.g. 8,4)"
        ) from None
    if min(sizes) < 1:
        raise ValueError(f"--buffers {args.buffers!r}: every buffer size must be >= 1")
    return levels, sizes


def run_hierarchy(
    target: Any,
    target_dir: str,
    hierarchy: list[str],
    buffers: list[int] | None,
    prompt: str,
    chat: bool,
    max_new_tokens: int,
    sampling: Any,
    seed: int | None,
) -> dict[str, Any]:
    """`generate --hierarchy`: the levels loaded and checked, one generation, its record."""
    from transformers import AutoTokenizer

    from vllm_moa.cli.common import encode_prompt
    from vllm_moa.factories.proposers import level_proposer
    from vllm_moa.hf_target.eos import eos_ids
    from vllm_moa.hsd.hierarchy import HierarchicalEngine, Level

    sizes = buffers or [DEFAULT_BUFFER] * len(hierarchy)
    if len(sizes) != len(hierarchy):
        raise ValueError(
            f"--buffers has {len(sizes)} sizes for {len(hierarchy)} levels: give one T per "
            "level, bottom first"
        )
    dtype, device = target.dtype, target.device
    levels = [
        Level(entry, level_proposer(entry, target, target_dir, dtype, device), size)
        for entry, size in zip(hierarchy, sizes, strict=True)
    ]
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    ids = encode_prompt(tokenizer, prompt, chat, target_dir)
    result = HierarchicalEngine(target, levels).generate(
        ids, max_new_tokens, sampling, eos_token_ids=eos_ids(tokenizer, target.model), seed=seed
    )
    record: dict[str, Any] = {
        "text": tokenizer.decode(result.token_ids, skip_special_tokens=True),
        "token_ids": result.token_ids,
        "prompt_tokens": len(ids),
        "finish_reason": result.finish_reason,
        "speculative": True,
        "hierarchy": hierarchy,
        "buffers": sizes,
    }
    record.update(result.stats.to_dict())
    return record


def read_prompt_records(path: str, limit: int) -> list[str]:
    """`prompt` (or the first of `turns`) of the first `limit` records of a JSONL file (.gz
    too); any other file is one prompt."""
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"prompts file {file} does not exist")
    if not file.name.endswith((".jsonl", ".jsonl.gz")):
        return [file.read_text()]
    opener: Any = gzip.open if file.suffix == ".gz" else open
    prompts: list[str] = []
    with opener(file, "rt", encoding="utf-8") as f:
        for line in f:
            if len(prompts) == limit:
                break
            if line.strip():
                record = json.loads(line)
                prompts.append(record["prompt"] if "prompt" in record else record["turns"][0])
    if not prompts:
        raise ValueError(f"prompts file {file} holds no records")
    return prompts


def _measured_inputs(args: argparse.Namespace) -> Any:
    """`hsd-plan --measure`: load the target and candidates, measure, save if asked."""
    from transformers import AutoTokenizer

    from vllm_moa.cli.common import runtime
    from vllm_moa.factories.proposers import level_proposer, parse_levels
    from vllm_moa.hf_target import HFTarget
    from vllm_moa.hsd.measure import BUILTIN_PROMPTS, MeasureConfig, measure_inputs

    if args.target is None or args.candidates is None:
        raise ValueError("--measure needs --target DIR and --candidates LEVELS (e.g. ngram,DIR)")
    entries = parse_levels(args.candidates)
    if len(set(entries)) != len(entries):
        raise ValueError(f"--candidates {args.candidates!r} names a level twice")
    device, dtype = runtime(args)
    target = HFTarget.from_pretrained(args.target, dtype=dtype, device=device)
    candidates = {e: level_proposer(e, target, args.target, dtype, device) for e in entries}
    texts = (
        read_prompt_records(args.prompts, args.num_prompts)
        if args.prompts
        else list(BUILTIN_PROMPTS[: args.num_prompts])
    )
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    prompts = [list(tokenizer(t)["input_ids"]) for t in texts]
    config = MeasureConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature)
    inputs = measure_inputs(target, candidates, prompts, config)
    inputs.notes["target"] = args.target
    if args.out:
        inputs.save(args.out)
    return inputs


def hsd_plan(args: argparse.Namespace) -> int:
    from vllm_moa.hsd.plan import PlanInputs, best_plans

    if args.temperature < 0:
        raise ValueError(f"--temperature must be >= 0, got {args.temperature}")
    if args.from_file is not None:
        if args.target is not None or args.candidates is not None:
            raise ValueError(
                "--from reads measured inputs: --target and --candidates go with --measure"
            )
        inputs = PlanInputs.load(args.from_file)
    else:
        inputs = _measured_inputs(args)
    plans = best_plans(inputs, args.max_buffer)[: args.top]
    if args.json:
        record = {
            "plan": plans[0].to_dict(),
            "plans": [p.to_dict() for p in plans],
            "inputs": inputs.to_dict(),
        }
        print(json.dumps(record))
    else:
        _print_plans(inputs, plans)
    return 0


def _print_plans(inputs: Any, plans: list[Any]) -> None:
    """The measured inputs, the best stack with the command that runs it, then a table."""
    target = inputs.target
    print(
        f"{len(inputs.candidates)} candidates; target pass {_ms(target.base_s)} + "
        f"{_ms(target.per_token_s)} per token"
    )
    for c in inputs.candidates:
        score = "cannot verify" if c.score is None else f"scoring pass {_ms(c.score.base_s)} + "
        score += "" if c.score is None else f"{_ms(c.score.per_token_s)} per token"
        alphas = ", ".join(f"{up} {a:.2f}" for up, a in inputs.acceptance.get(c.name, {}).items())
        print(
            f"  {c.name}: draft step {_ms(c.draft_step_s)}, {score}, taking verified tokens "
            f"{_ms(c.commit.base_s)} + {_ms(c.commit.per_token_s)} per token, "
            f"draft rate {c.draft_rate:.2f}; alpha: {alphas}"
        )
    best = plans[0]
    print(f"\nbest: {_stack(best.levels)}, predicted {_ms(best.latency_s)} per token")
    if best.levels:
        print(
            f"run it: vllm-moa generate --target {inputs.notes.get('target', 'TARGET')} "
            f"--hierarchy {','.join(best.levels)} --buffers {','.join(map(str, best.buffers))} "
            "--prompt ..."
        )
    print("\n  ms/token    tok/s  tokens/target call  stack (buffers)")
    for plan in plans:
        sizes = f" ({','.join(map(str, plan.buffers))})" if plan.levels else ""
        print(
            f"  {plan.latency_s * 1e3:8.3f} {1 / plan.latency_s:8.1f} "
            f"{plan.tokens_per_target_call:19.2f}  {_stack(plan.levels)}{sizes}"
        )


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms"


def _stack(levels: tuple[str, ...]) -> str:
    return " -> ".join([*levels, "target"]) if levels else "plain decoding"
