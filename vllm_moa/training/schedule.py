"""Per-step randomness of training, reproducible from (seed, step, micro-batch)."""

from __future__ import annotations

import torch

from vllm_moa.model.masks import bounded_memory_limits
from vllm_moa.training.config import TrainConfig


def step_generator(seed: int, step: int, micro: int) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 1_000_003 + step) * 4099 + micro)


def memory_limits(
    prompt_len: torch.Tensor, seq_len: int, cfg: TrainConfig, gen: torch.Generator
) -> torch.Tensor:
    """[B, T]: per sequence a refresh interval K ~ U[refresh_min, refresh_max]; cycles of K
    tokens start at the prompt's end (MOA_SPEC's K-step bounded Cross-Attention mask)."""
    ks = torch.randint(cfg.refresh_min, cfg.refresh_max + 1, (len(prompt_len),), generator=gen)
    return torch.stack(
        [
            bounded_memory_limits(seq_len, int(p), int(k))
            for p, k in zip(prompt_len.tolist(), ks.tolist(), strict=True)
        ]
    )
