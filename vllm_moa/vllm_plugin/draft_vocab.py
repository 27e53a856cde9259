"""MoA's draft vocabulary inside vLLM: greedy drafts over the draft tokens only.

A MoA drafter with a draft vocabulary (config.draft_vocab_size, its `draft_ids`) drafts only
those tokens. Where the target's LM head allows it (`VllmTargetView.lm_head_rows`: one
unquantized, bias-free weight, no tensor parallelism), its rows of the draft tokens are gathered
once, at load, and a draft step computes `h @ rows.T` [B, n] and maps the argmax to its token:
n x E of the head read per step instead of V x E. vLLM's logits processor would then soft-cap
(tanh) and scale (by a positive factor) those outputs: both strictly increasing, so the argmax
of the raw outputs is the argmax of the logits (up to values the processing rounds into a tie;
among equal values both take the first, the smallest id, as the ids ascend). Elsewhere (tensor
parallelism, a quantized head) the step computes the logits as before and takes the argmax over
the draft columns: the same drafts, no saving.

Both paths make their index tensors once, on the device: a step has no host synchronisation
and no data-dependent shape, so the V2 speculator's CUDA graphs capture it (draft_graphs.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from vllm_moa.vllm_plugin.cpu_linear import DispatchedLinear
from vllm_moa.vllm_plugin.target_view import VllmTargetView


@dataclass(frozen=True)
class DraftVocabHead:
    token_ids: torch.Tensor  # int64 [n] on the proposer's device: the draft tokens, ascending
    rows: nn.Module | None  # [B, E] -> [B, n], the LM head's rows of token_ids; None: no saving
    dtype: torch.dtype | None  # what `rows` multiplies in (hidden states are cast to it)

    @property
    def gathered(self) -> bool:
        """Whether drafts read only the draft tokens' rows of the head (else the whole head)."""
        return self.rows is not None

    def argmax(
        self, hidden: torch.Tensor, logits: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        """Greedy drafts: final-normalised hidden states [B, E] -> int64 [B], the draft token of
        the largest logit. `logits`: the target's own compute_logits ([B, E] -> [B, V]), used
        when the rows could not be gathered."""
        if self.rows is None:
            return self.token_ids[logits(hidden).index_select(-1, self.token_ids).argmax(-1)]
        assert self.dtype is not None
        return self.token_ids[self.rows(hidden.to(self.dtype)).argmax(-1)]


def draft_vocab_head(
    target: VllmTargetView, token_ids: torch.Tensor, tp: int, cpu_gemm: bool
) -> DraftVocabHead:
    """The draft head of a drafter whose draft tokens are `token_ids` (int64 [n], ascending, on
    the proposer's device): the LM head's rows gathered where `target` allows it and the head
    is whole on this rank (tensor parallelism `tp` 1), in the logits' dtype; on the CPU behind
    vLLM's CPU GEMM dispatch (`cpu_gemm`), as the target's own head and the drafter's linears
    run there."""
    ids = token_ids.to(torch.long)
    # Under tensor parallelism each rank holds a vocabulary shard of the head: compute_logits
    # gathers the logits, the draft columns are taken from them.
    rows = target.lm_head_rows(ids) if tp == 1 else None
    if rows is None:
        return DraftVocabHead(ids, None, None)
    linear = nn.Linear(rows.shape[1], rows.shape[0], bias=False, device="meta")
    linear.weight = nn.Parameter(rows, requires_grad=False)
    head: nn.Module = linear
    if rows.device.type == "cpu" and cpu_gemm:
        head = DispatchedLinear(linear)
    return DraftVocabHead(ids, head, rows.dtype)
