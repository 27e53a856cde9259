"""Logits over a reduced draft vocabulary, put back over the target's whole vocabulary: each
draft token's logit at its target id, -inf elsewhere (as vLLM's `compute_logits` for EAGLE-3's
reduced head does), so argmax, top-k and sampling pick draft tokens only and softmax gives every
other token probability 0. EAGLE-3's own head (drafters/eagle3/model.py) and the target's head
over MoA's draft vocabulary (hf_target/vocab_head.py) both scatter this way."""

from __future__ import annotations

import torch


def full_vocab_logits(
    draft: torch.Tensor, token_ids: torch.Tensor, vocab_size: int
) -> torch.Tensor:
    """draft [..., n] logits of the draft tokens, token_ids int64 [n] their target ids (distinct,
    on draft's device) -> [..., vocab_size] in draft's dtype and device: draft[..., i] at
    token_ids[i], -inf elsewhere."""
    full = draft.new_full((*draft.shape[:-1], vocab_size), float("-inf"))
    return full.index_copy(-1, token_ids, draft)
