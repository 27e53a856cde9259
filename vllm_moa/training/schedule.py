"""Per-step randomness of training, reproducible from (seed, step, micro-batch)."""

from __future__ import annotations

import torch

from vllm_moa.model.masks import bounded_memory_limits, release_memory_limits
from vllm_moa.training.config import TrainConfig


def step_generator(seed: int, step: int, micro: int) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 1_000_003 + step) * 4099 + micro)


def response_tokens(loss_mask: torch.Tensor) -> torch.Tensor:
    """[B, T] bool: token t is a response token (a training target: position t - 1 predicts
    it); token 0 counts as one (its limit is 0 either way)."""
    first = torch.ones_like(loss_mask[:, :1], dtype=torch.bool)
    return torch.cat([first, loss_mask[:, :-1].to(torch.bool)], dim=1)


def memory_limits(
    prompt_len: torch.Tensor,
    seq_len: int,
    cfg: TrainConfig,
    gen: torch.Generator,
    loss_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """[B, T]: per sequence a refresh interval K ~ U[refresh_min, refresh_max]; cycles of K
    tokens start at the prompt's end and at each later run of response tokens (`loss_mask`,
    the batch's: a conversation's later turns), MOA_SPEC's K-step bounded Cross-Attention mask;
    `cfg.ca_memory == "release"`: the MoA authors' mask instead (`release_memory_limits`)."""
    ks = torch.randint(cfg.refresh_min, cfg.refresh_max + 1, (len(prompt_len),), generator=gen)
    if cfg.ca_memory == "release":
        if loss_mask is None:
            raise ValueError("ca_memory 'release' needs the batch's loss mask")
        turns = response_tokens(loss_mask[:, :seq_len].cpu())
        return torch.stack(
            [
                release_memory_limits(seq_len, int(k), r)
                for k, r in zip(ks.tolist(), turns, strict=True)
            ]
        )
    response: list[torch.Tensor | None] = [None] * len(prompt_len)
    if loss_mask is not None:
        response = list(response_tokens(loss_mask[:, :seq_len].cpu()))
    return torch.stack(
        [
            bounded_memory_limits(seq_len, int(p), int(k), r)
            for p, k, r in zip(prompt_len.tolist(), ks.tolist(), response, strict=True)
        ]
    )


def staircase_probability(step: int, cfg: TrainConfig) -> float:
    """The probability that a sequence of training step `step` (1-based) trains with SA's
    staircase (SA sees only the tokens since its cycle's start): `half`, every sequence in the
    first half of the steps; `release`, the MoA authors' schedule, falling linearly from 1 to 0
    over the first half (their per-epoch 1 - epoch / (epochs / 2), here per step)."""
    half = cfg.max_steps // 2
    if cfg.sa_staircase == "half":
        return 1.0 if step <= half else 0.0
    if cfg.sa_staircase == "release":
        return max(0.0, 1.0 - (step - 1) / max(1, half))
    return 0.0


def staircase_rows(probability: float, rows: int, gen: torch.Generator) -> torch.Tensor | None:
    """[rows] bool: the sequences that train with the staircase (None: none); drawn from `gen`
    only when the probability is strictly between 0 and 1, so other runs' draws are unchanged."""
    if probability <= 0:
        return None
    if probability >= 1:
        return torch.ones(rows, dtype=torch.bool)
    return torch.rand(rows, generator=gen) < probability
