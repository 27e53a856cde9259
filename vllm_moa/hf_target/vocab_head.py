"""The target's LM head over a draft vocabulary, for a drafter whose drafts may only be draft
tokens (MoA with `draft_vocab_size`): the head's rows of those tokens, gathered once, give their
logits, scattered into a -inf tensor over the whole vocabulary (as EAGLE-3's reduced head and
vLLM's `compute_logits` for it do). A draft step then reads n x E of the head instead of V x E,
and every caller (argmax for chains, top-k for trees, sampling) runs unchanged on logits in
which only draft tokens are finite."""

from __future__ import annotations

import torch
from torch import nn

from vllm_moa.model.draft_logits import full_vocab_logits
from vllm_moa.model.packed_linear import pack_linears


class VocabHead(nn.Module):
    """An LM head (`weight` [V, E], `bias` [V] or None) restricted to `token_ids` (int64 [n],
    strictly ascending target ids): hidden [..., E] ->
    logits [..., V] float32, the head's own at `token_ids` and -inf elsewhere. HFTarget's
    `lm_logits` is the head's output as is (no logit scaling or soft-capping in the adapter's
    model types), so the finite logits are its columns at those ids, up to float rounding (a
    GEMM of n rows instead of V)."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, token_ids: torch.Tensor
    ) -> None:
        super().__init__()
        if token_ids.dim() != 1:
            raise ValueError(
                f"token_ids must hold one id per draft token, got shape {tuple(token_ids.shape)}"
            )
        ids = token_ids.to(device=weight.device, dtype=torch.long)
        self.vocab_size = int(weight.shape[0])
        rows = nn.Linear(
            weight.shape[1], ids.shape[0], bias=bias is not None, device=weight.device,
            dtype=weight.dtype,
        )  # fmt: skip
        with torch.no_grad():  # a copy: the rows are read once per step, the head never
            rows.weight.copy_(weight[ids])
            if bias is not None:
                rows.bias.copy_(bias[ids])
        rows.requires_grad_(False)
        self.rows = rows
        pack_linears(self)  # CPU: oneDNN on prepacked rows, as the target's own head
        self.token_ids: torch.Tensor
        self.register_buffer("token_ids", ids)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        draft = self.rows(hidden).float()  # [..., n]
        return full_vocab_logits(draft, self.token_ids, self.vocab_size)
