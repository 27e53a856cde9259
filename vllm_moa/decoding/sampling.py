"""Sampling parameters, logits processing, and lossless verification of a drafted chain."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 = greedy; top_k 0 = off; top_p 1 = off (vLLM's conventions)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self) -> None:
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be a finite number, got {self.temperature!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 = off), got {self.top_k!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Sampling distribution [..., V] (float32) after temperature, top-k and top-p.

    top-k keeps the k largest logits; top-p keeps the smallest set of most likely tokens whose
    mass reaches p (the token that crosses p is kept), as vLLM and HF do.
    """
    if params.greedy:
        raise ValueError("probabilities() needs temperature > 0; greedy decoding uses argmax")
    logits = logits.float() / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        mass_before = sorted_p.cumsum(dim=-1) - sorted_p
        drop_sorted = mass_before >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token id from a distribution [V] (a device sync, visible here)."""
    return int(torch.multinomial(probs, 1, generator=generator).item())


@dataclass(frozen=True)
class Verdict:
    num_accepted: int  # drafts accepted, 0..K
    next_token: int  # the correction (on rejection) or bonus (all accepted) token


def verify_greedy(draft: list[int], target_logits: torch.Tensor) -> Verdict:
    """Accept drafts while they equal the target's argmax. target_logits: [K+1, V]."""
    best = target_logits.argmax(dim=-1).tolist()  # device sync
    n = 0
    while n < len(draft) and draft[n] == best[n]:
        n += 1
    return Verdict(n, best[n])


def verify_rejection(
    draft: list[int],
    draft_probs: torch.Tensor,  # [K, V]: the distributions the drafts were sampled from
    target_probs: torch.Tensor,  # [K+1, V]: the target's processed distributions
    generator: torch.Generator | None,
) -> Verdict:
    """Speculative (rejection) sampling, Leviathan et al. 2023: lossless for any draft q.

    Draft i is accepted with probability min(1, p_i(x)/q_i(x)); on the first rejection the
    replacement is drawn from normalise(max(0, p_i - q_i)); if all K pass, the bonus token is
    drawn from p_{K+1}.
    """
    k = len(draft)
    draft_probs = draft_probs.to(target_probs.device)  # prompt lookup's point masses: on the CPU
    idx = torch.arange(k, device=target_probs.device)
    tok = torch.tensor(draft, device=target_probs.device)
    p = target_probs[idx, tok]
    q = draft_probs[idx, tok]
    u = torch.rand(k, generator=generator, device=p.device)
    # u < p/q written without the division (q > 0 for sampled tokens; p may be 0).
    accepted = (u * q < p).tolist()  # device sync
    for i, ok in enumerate(accepted):
        if not ok:
            residual = (target_probs[i] - draft_probs[i]).clamp_min(0.0)
            total = residual.sum()
            # total == 0 only if p == q exactly, where rejection has probability 0.
            residual = residual / total if total > 0 else target_probs[i]
            return Verdict(i, sample(residual, generator))
    return Verdict(k, sample(target_probs[k], generator))
