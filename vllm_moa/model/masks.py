"""Attention masks of the drafter. Every mask is bool, True = the query may attend to the key.

Memory row j of the Cross-Attention is the LSA summary of the target's K|V at token position j.
A query at position i predicts the target's hidden state at i (hence token i + 1); the target has
not processed token i yet when drafting it, so a query may only see rows j < memory_limit[i] <= i.
"""

from __future__ import annotations

import torch


def causal_mask(q_positions: torch.Tensor, num_keys: int) -> torch.Tensor:
    """[T, S]: query at absolute position p sees keys 0..p (keys are positions 0..S-1)."""
    keys = torch.arange(num_keys, device=q_positions.device)
    return keys[None, :] <= q_positions[:, None]


def memory_mask(memory_limit: torch.Tensor, num_rows: int) -> torch.Tensor:
    """[T, S]: query t sees memory rows j < memory_limit[t]."""
    rows = torch.arange(num_rows, device=memory_limit.device)
    return rows[None, :] < memory_limit[:, None]


def bounded_memory_limits(
    seq_len: int, prompt_len: int, refresh_every: int, response: torch.Tensor | None = None
) -> torch.Tensor:
    """Memory limits [seq_len] of the K-step bounded Cross-Attention used in training.

    Prompt positions see every earlier row (limit = i). Response positions are grouped in cycles
    of `refresh_every` tokens starting at `prompt_len`; every query of a cycle sees only the rows
    before the cycle's first position, exactly as drafted tokens do between two verifications.

    `response` [seq_len] bool marks the response tokens (an assistant's turns); None: every
    token from `prompt_len` on. A token outside the response (a later user turn) is prefilled at
    inference, so it sees every row before it (limit = i), and each later run of response tokens
    starts cycles of its own, as the first draft of a turn sees the whole conversation before it.
    """
    if refresh_every < 1:
        raise ValueError(f"refresh_every must be >= 1, got {refresh_every}")
    if not 0 <= prompt_len <= seq_len:
        raise ValueError(f"prompt_len must be in [0, seq_len={seq_len}], got {prompt_len}")
    i = torch.arange(seq_len)
    answer = i >= prompt_len
    if response is not None:
        answer &= response.to(torch.bool).cpu()
    first = answer & ~torch.cat([torch.zeros(1, dtype=torch.bool), answer[:-1]])
    anchor = torch.cummax(torch.where(first, i, 0), dim=0).values
    cycle_start = anchor + torch.div(i - anchor, refresh_every, rounding_mode="floor") * (
        refresh_every
    )
    return torch.where(answer, cycle_start, i)


def release_memory_limits(seq_len: int, every: int, response: torch.Tensor) -> torch.Tensor:
    """Memory limits [seq_len] as the MoA authors' training code masks the Cross-Attention
    (their `moa_spec.py`, `--ca-memory release`): refresh points are the positions that are
    multiples of `every` (from the sequence start) and every token outside `response`; a query
    sees the rows up to and including the last refresh point at or before it, so a refresh point
    sees its own row, which no draft does at inference (the first draft after a verify sees the
    rows before its own position). Reproduced for comparison, not as a default."""
    if every < 1:
        raise ValueError(f"every must be >= 1, got {every}")
    i = torch.arange(seq_len)
    refresh = (i % every == 0) | ~response.to(torch.bool).cpu()
    return torch.cummax(torch.where(refresh, i, 0), dim=0).values + 1


def aligned_pass_mask(
    pass_index: int, seq_len: int, device: torch.device | None = None
) -> torch.Tensor:
    """[T, (j+1)*T], j = pass_index: the keys query i sees in pass j (0-based) of EAGLE's
    multi-pass training (HASS, GRIFFIN), where query i is the (j+1)-th draft of a cycle whose
    first draft is at i - j. Key block p holds the keys pass p computed: block 0 (true features)
    at positions <= i - j, before the cycle; block p >= 1 only at i - (j - p), the cycle's
    position that pass p drafted. Pass 0 is the causal mask."""
    if pass_index < 0:
        raise ValueError(f"pass_index must be >= 0, got {pass_index}")
    i = torch.arange(seq_len, device=device)[:, None]
    u = torch.arange(seq_len, device=device)[None, :]
    blocks = [u <= i - pass_index]
    blocks += [u == i - (pass_index - p) for p in range(1, pass_index + 1)]
    return torch.cat(blocks, dim=1)
