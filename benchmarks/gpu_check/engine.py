"""Step 4: the standalone engine on the card. MoA's greedy output (TLI 0 and 1; chains of 4 and
EAGLE-2 trees, verified through the Triton tree kernel on CUDA) against plain greedy decoding on
a small random Llama target, in fp32 and bf16; then the sampling path (temperature, top-k,
top-p, seeded) in the run's dtype.

A random drafter's drafts are mostly rejected, so a vocabulary of 16 keeps some accepted. In
bf16 a speculative pass and a plain one round differently (K + 1 or tree tokens in one pass
against one token), so greedy outputs may part where the target's two best logits are within
rounding of each other: every first divergence is reported with the margin between the two
tokens in a full recompute (fp32 must have none; bf16's must be near ties)."""

from __future__ import annotations

from typing import Any

import torch

from benchmarks.cost_model import Shape, build_target
from benchmarks.gpu_check.common import StepContext
from vllm_moa.decoding import SpeculativeEngine
from vllm_moa.decoding.sampling import SamplingParams
from vllm_moa.decoding.tree import TreeParams
from vllm_moa.drafters.moa.model import MoADrafter
from vllm_moa.drafters.moa.proposer import MoAProposer
from vllm_moa.drafters.presets import TargetInfo, make_config

TARGET = Shape(16, 128, 256, 3, 2, 1, 64, 10000.0)  # tests/conftest.py's, with vocab 16
PROMPTS = ([1, 5, 3], [7] * 9, list(range(16)) * 2)
NEW_TOKENS = 24
CPU_PROMPTS, CPU_NEW_TOKENS = 2, 16  # the CPU mode's, to stay within seconds
MODES: dict[str, TreeParams | None] = {
    "k4": None,
    "tree_d3_b2_m5": TreeParams(3, 2, 5),
    "tree_d6_b8_m62": TreeParams(6, 8, 62),  # the paper's
}
# bf16 keeps 8 bits (a relative 2^-9 per rounding), compounded over 3 layers and the LM head:
# logits within 2% of the largest one count as a tie.
NEAR_TIE = 0.02


def drafter(target: Any, tli: int, dtype: torch.dtype) -> MoADrafter:
    info = TargetInfo(target.shape, target.config.num_attention_heads)
    d = MoADrafter(make_config(info, "small", tli=tli))
    d.init_weights(tli)
    return d.to(device=target.device, dtype=dtype).eval()


def divergence(target: Any, prompt: list[int], plain: list[int], got: list[int]) -> dict:
    """Where speculative output first leaves plain output, and the target's margin there."""
    i = next(j for j, (a, b) in enumerate(zip(plain, got, strict=False)) if a != b)
    target.reset()
    logits = target.forward(torch.tensor(prompt + plain[:i])).logits[-1].float()
    margin = float(logits[plain[i]] - logits[got[i]])  # device sync
    scale = float(logits.abs().max())
    return {"index": i, "plain": plain[i], "speculative": got[i], "margin": margin,
            "relative_margin": margin / scale if scale else 0.0}  # fmt: skip


def workload(ctx: StepContext) -> tuple[tuple[list[int], ...], int]:
    """(prompts, new tokens per prompt)."""
    return (PROMPTS[:CPU_PROMPTS], CPU_NEW_TOKENS) if ctx.cpu else (PROMPTS, NEW_TOKENS)


def greedy(ctx: StepContext, dtype: torch.dtype) -> list[dict[str, Any]]:
    """Every (TLI, mode) row, each added to the step's figures as it finishes."""
    prompts, new = workload(ctx)
    target = build_target(TARGET, ctx.device, dtype)
    plain = [SpeculativeEngine(target).generate(p, new).token_ids for p in prompts]
    rows: list[dict[str, Any]] = []
    for tli in (0, 1):
        engine = SpeculativeEngine(target, MoAProposer(drafter(target, tli, dtype), target))
        for mode, tree in MODES.items():
            row: dict[str, Any] = {"dtype": str(dtype), "tli": tli, "mode": mode}
            row.update(equal=0, accepted=0, drafted=0, divergences=[])
            for prompt, want in zip(prompts, plain, strict=True):
                result = engine.generate(prompt, new, tree=tree, adaptive=False)
                row["accepted"] += result.stats.num_accepted_tokens
                row["drafted"] += result.stats.num_draft_tokens
                if result.token_ids == want:
                    row["equal"] += 1
                else:
                    row["divergences"].append(divergence(target, prompt, want, result.token_ids))
            rows.append(row)
            ctx.part.figures["greedy"].append(row)
            ctx.part.save()
    return rows


def sampling(ctx: StepContext) -> dict[str, Any]:
    """The sampling path runs: seeded chains and trees, the same text for the same seed."""
    prompts, new = workload(ctx)
    target = build_target(TARGET, ctx.device, ctx.dtype)
    engine = SpeculativeEngine(target, MoAProposer(drafter(target, 1, ctx.dtype), target))
    params = SamplingParams(temperature=0.8, top_k=8, top_p=0.95)
    out: dict[str, Any] = {"params": params.__dict__}
    for mode, tree in MODES.items():
        runs = [
            engine.generate(prompts[-1], new, params, seed=s, tree=tree, adaptive=False)
            for s in (0, 0, 1)
        ]
        ids = [r.token_ids for r in runs]
        out[mode] = {
            "lengths": [len(t) for t in ids],
            "in_vocabulary": all(0 <= t < TARGET.vocab_size for r in ids for t in r),
            "same_seed_same_text": ids[0] == ids[1],
            "accepted": sum(r.stats.num_accepted_tokens for r in runs),
        }
    return out


def run(ctx: StepContext) -> None:
    from vllm_moa.model.layers import use_kernels

    part = ctx.part
    prompts, new = workload(ctx)
    part.figures.update(prompts=len(prompts), new_tokens=new, greedy=[])
    part.figures["kernels"] = use_kernels(torch.device(ctx.device))
    for dtype in (torch.float32, torch.bfloat16):
        rows = greedy(ctx, dtype)
        name = str(dtype).removeprefix("torch.")
        if dtype == torch.float32:
            part.check(f"greedy_equal_{name}", all(r["equal"] == len(prompts) for r in rows))
        else:
            margins = [abs(d["relative_margin"]) for r in rows for d in r["divergences"]]
            part.figures["bf16_all_equal"] = not margins
            part.check(f"greedy_{name}_equal_or_near_ties", all(m <= NEAR_TIE for m in margins))
        part.check(f"drafts_accepted_{name}", sum(r["accepted"] for r in rows) > 0)
        part.save()
    part.figures["sampling"] = sampling(ctx)
    for mode in MODES:
        got = part.figures["sampling"][mode]
        ok = got["in_vocabulary"] and got["same_seed_same_text"]
        part.check(f"sampling_{mode}", ok and got["lengths"] == [new] * 3)
