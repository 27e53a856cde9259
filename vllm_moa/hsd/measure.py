"""Measure what the hierarchy planner needs, on this machine and these prompts: the seconds of
each candidate's draft step, scoring pass and taking in of verified tokens, and of the target's
pass (over 1..n tokens, fitted as base + per_token * n), and the per-token acceptance of each
candidate by each later one and by the target, read from real hierarchical decoding runs
(LevelStats.alpha)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from vllm_moa.decoding.proposer import LevelProposer, LevelScorer
from vllm_moa.decoding.sampling import SamplingParams
from vllm_moa.hf_target.adapter import HFTarget
from vllm_moa.hsd.hierarchy import HierarchicalEngine, Level
from vllm_moa.hsd.plan import TARGET, Candidate, PassCost, PlanInputs

# Used when no prompts are given: code and prose, some of it repetitive (prompt lookup's case).
BUILTIN_PROMPTS = (
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "import os\nimport sys\n\n\ndef main(argv):\n    for path in argv[1:]:\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):\n",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
)


@dataclass(frozen=True)
class MeasureConfig:
    max_new_tokens: int = 64  # per prompt and acceptance run
    buffer: int = 4  # T of every level in the acceptance runs (alpha barely depends on it)
    pass_sizes: tuple[int, ...] = (1, 2, 4, 8)  # tokens per timed pass
    repeats: int = 5  # timings per size (the median is kept)
    temperature: float = 0.0  # the sampling the acceptance is measured at (0: greedy)

    def __post_init__(self) -> None:
        for name in ("max_new_tokens", "buffer", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.pass_sizes or min(self.pass_sizes) < 1:
            raise ValueError(f"pass_sizes must be >= 1, got {self.pass_sizes}")


def measure_inputs(
    target: HFTarget,
    candidates: dict[str, LevelProposer],  # bottom-up, by LEVELS entry
    prompts: Sequence[Sequence[int]],
    config: MeasureConfig,
) -> PlanInputs:
    if not prompts:
        raise ValueError("no prompts to measure on")
    prompt = list(prompts[0])
    found = [
        Candidate(
            name,
            draft_step_s=_draft_step(target, prop, prompt, config),
            score=_fit([_score(target, prop, prompt, n, config) for n in config.pass_sizes])
            if isinstance(prop, LevelScorer)
            else None,
            commit=_fit([_commit(target, prop, prompt, n, config) for n in config.pass_sizes]),
        )
        for name, prop in candidates.items()
    ]
    target_cost = _fit([_target_pass(target, prompt, n, config) for n in config.pass_sizes])
    acceptance, rates = _acceptance(target, candidates, prompts, config)
    found = [Candidate(c.name, c.draft_step_s, c.score, rates[c.name], c.commit) for c in found]
    notes = {
        "prompts": len(prompts),
        "max_new_tokens": config.max_new_tokens,
        "buffer": config.buffer,
        "temperature": config.temperature,
        "pass_sizes": list(config.pass_sizes),
        "device": str(target.device),
        "dtype": str(target.dtype).removeprefix("torch."),
    }
    return PlanInputs(tuple(found), target_cost, acceptance, notes)


def _seconds(target: HFTarget, run: Callable[[], object], config: MeasureConfig) -> float:
    """Median wall time of `run` (synchronised on CUDA), after one warm-up call."""
    sync = torch.cuda.synchronize if target.device.type == "cuda" else (lambda: None)
    times = []
    for i in range(config.repeats + 1):
        sync()
        began = time.perf_counter()
        run()
        sync()
        if i:
            times.append(time.perf_counter() - began)
    return statistics.median(times)


def _fit(points: list[tuple[int, float]]) -> PassCost:
    """Least squares seconds = base + per_token * n over the timed sizes (clipped at 0)."""
    ns = [float(n) for n, _ in points]
    ts = [t for _, t in points]
    mean_n, mean_t = statistics.fmean(ns), statistics.fmean(ts)
    spread = sum((n - mean_n) ** 2 for n in ns)
    slope = sum((n - mean_n) * (t - mean_t) for n, t in points) / spread if spread else 0.0
    slope = max(0.0, slope)
    return PassCost(max(0.0, mean_t - slope * mean_n), slope)


def _prefilled(target: HFTarget, prop: LevelProposer | None, prompt: list[int]) -> None:
    target.reset()
    out = target.forward(torch.tensor(prompt), prop.hidden_layers if prop else ())
    if prop is not None:
        prop.start(prompt, out)


def _draft_step(
    target: HFTarget, prop: LevelProposer, prompt: list[int], config: MeasureConfig
) -> float:
    """Seconds per drafted token, drafting `buffer` after the prompt (prompt lookup: per token
    it found, or per lookup when it found none)."""
    _prefilled(target, prop, prompt)
    params, k = SamplingParams(temperature=config.temperature), config.buffer
    drafted = len(prop.draft_after([prompt[-1]], k, params, None).tokens)
    seconds = _seconds(target, lambda: prop.draft_after([prompt[-1]], k, params, None), config)
    return seconds / max(1, drafted)


def _score(
    target: HFTarget, prop: LevelScorer, prompt: list[int], n: int, config: MeasureConfig
) -> tuple[int, float]:
    """A scoring pass over n positions: the last token and n - 1 proposed ones."""
    _prefilled(target, prop, prompt)
    tokens = (prompt * n)[: n - 1]
    return n, _seconds(target, lambda: prop.score([prompt[-1]], tokens), config)


def _commit(
    target: HFTarget, prop: LevelProposer, prompt: list[int], n: int, config: MeasureConfig
) -> tuple[int, float]:
    """Taking n target-verified tokens in (`catch_up`), after the rest of the prompt (a fresh
    start before each timing: catch_up changes the state)."""
    n = min(n, len(prompt) - 1)  # at least one prompt token to start from
    target.reset()
    out = target.forward(torch.tensor(prompt), prop.hidden_layers)
    before, rows = (
        out.select(list(range(len(prompt) - n))),
        out.select(list(range(len(prompt) - n, len(prompt)))),
    )
    sync = torch.cuda.synchronize if target.device.type == "cuda" else (lambda: None)
    times = []
    for i in range(config.repeats + 1):
        prop.start(prompt[:-n], before)
        sync()
        began = time.perf_counter()
        prop.catch_up(prompt[-n:], rows)
        sync()
        if i:
            times.append(time.perf_counter() - began)
    return n, statistics.median(times)


def _target_pass(
    target: HFTarget, prompt: list[int], n: int, config: MeasureConfig
) -> tuple[int, float]:
    """A verification pass over n tokens after the prompt (cropped back after each)."""
    _prefilled(target, None, prompt)
    ids = torch.tensor((prompt * n)[:n])

    def run() -> None:
        target.forward(ids)
        target.crop(len(prompt))

    return n, _seconds(target, run, config)


def _acceptance(
    target: HFTarget,
    candidates: dict[str, LevelProposer],
    prompts: Sequence[Sequence[int]],
    config: MeasureConfig,
) -> tuple[dict[str, dict[str, float]], dict[str, float]]:
    """alpha for each candidate under each later scorer and under the target, from decoding runs
    of the stack [lower, upper] (or [lower]); and each candidate's draft rate at the bottom."""
    names = list(candidates)
    params = SamplingParams(temperature=config.temperature)
    acceptance: dict[str, dict[str, float]] = {name: {} for name in names}
    rates: dict[str, float] = {}
    for i, lower in enumerate(names):
        uppers = [n for n in names[i + 1 :] if isinstance(candidates[n], LevelScorer)]
        for upper in [None, *uppers]:
            stack = [lower] if upper is None else [lower, upper]
            levels = [Level(n, candidates[n], config.buffer) for n in stack]
            engine = HierarchicalEngine(target, levels)
            accepted = tested = drafted = requested = 0
            for seed, prompt in enumerate(prompts):
                bottom = engine.generate(prompt, config.max_new_tokens, params, seed=seed)
                record = bottom.stats.levels[0]
                accepted += record.accepted
                tested += record.accepted + record.rejections
                drafted += record.proposed
                requested += record.requested
            acceptance[lower][upper or TARGET] = accepted / tested if tested else 0.0
            if upper is None:
                rates[lower] = drafted / requested if requested else 1.0
    return acceptance, rates
