"""Incremental MoA drafting for one sequence.

State between cycles (p = number of tokens the target has verified):
- CA memory: keys/values of rows 0..p-1. Each verified token goes through LSA exactly once,
  when its verification cycle ends (the prompt at prefill).
- SA KV cache: positions whose SA input is known to be right (verified tokens).
- tokens: the verified tokens 0..p-1.

A cycle drafts from the last token (position p, sampled by the target but not yet run through
it): SA over the pending tokens, CA over the memory, then TLI's target tail layers (their draft
K/V are cropped off the target cache afterwards) and the target's LM head.
"""

from __future__ import annotations

import torch
from torch import Tensor

from vllm_moa.decoding.moa_tree import MoATreeDrafter
from vllm_moa.decoding.proposer import DraftProposal, choose_token
from vllm_moa.decoding.sampling import SamplingParams
from vllm_moa.decoding.tree import DraftTree
from vllm_moa.hf_target.adapter import HFTarget, TargetOutput
from vllm_moa.model.kv_cache import KVCache
from vllm_moa.model.layers import masked_attention
from vllm_moa.model.moa import MoADrafter


class MoAProposer:
    def __init__(self, drafter: MoADrafter, target: HFTarget) -> None:
        drafter.config.check_target(target.shape)
        # The "-LSA" variant reads the target's final hidden states instead of its K/V.
        self.hidden_layers: tuple[int, ...] = () if drafter.uses_lsa else (target.shape.num_layers,)
        self.drafter = drafter.eval()
        self.target = target
        self.tli = drafter.config.tli
        self.sa_cache = KVCache(1)
        self.memory = KVCache(1)  # CA keys/values of the LSA memory rows
        self.tokens: list[int] = []
        self._last_token: int | None = None  # proposed from, awaiting accept()

    @property
    def dtype(self) -> torch.dtype:
        return self.drafter.dtype

    @property
    def verified_len(self) -> int:
        return self.memory.length()

    def start(self, prompt_ids: list[int], prefill: TargetOutput) -> None:
        self.sa_cache.reset()
        self.memory.reset()
        self.tokens = list(prompt_ids)
        self._last_token = None
        self._extend_memory(prefill)

    @torch.no_grad()
    def _extend_memory(self, verified: TargetOutput) -> None:
        """Memory rows for the newly verified tokens (LSA + mean + Ekv2E on their K|V)."""
        start = self.memory.length()
        features = (
            verified.layer_kv
            if self.drafter.uses_lsa
            else verified.hidden_states[self.target.shape.num_layers]
        )
        memory = self.drafter.encode_memory(features.to(self.dtype))  # [n, E]
        positions = torch.arange(start, start + memory.shape[0], device=memory.device)
        k, v = self.drafter.memory_kv(memory[None], positions)
        self.memory.update(k, v, 0)

    @torch.no_grad()
    def draft_logits(self, position: int) -> torch.Tensor:
        """Drafter logits [V] predicting token position + 1, given tokens[0..position]."""
        first = self.sa_cache.length()
        device = self.target.device
        ids = torch.tensor(self.tokens[first : position + 1], device=device)
        positions = torch.arange(first, position + 1, device=device)
        emb = self.target.embed(ids).to(self.dtype)  # [n, E]
        if len(ids) > 1:  # SA K/V of the earlier pending tokens; the step adds the last one's
            k, v = self.drafter.self_attention.kv_from(emb[None, :-1], positions[:-1])
            self.sa_cache.update(k, v, 0)

        def self_attend(q: torch.Tensor, k: Tensor | None, v: Tensor | None) -> torch.Tensor:
            assert k is not None and v is not None
            keys, values = self.sa_cache.update(k[:, :, None], v[:, :, None], 0)
            # The query sees every cached key (all at positions <= it).
            return masked_attention(q[:, :, None], keys, values, None)[:, :, 0]

        def cross_attend(q: torch.Tensor, *_: Tensor | None) -> torch.Tensor:
            # Every memory row (< verified_len <= position) is visible to a drafted position.
            keys, values = self.memory.get(0)
            return masked_attention(q[:, :, None], keys, values, None)[:, :, 0]

        h = self.drafter.draft_step(emb[-1:], positions[-1:], self_attend, cross_attend)
        if self.tli:
            h = self.target.run_tail_layers(h, positions[-1:], self.tli)
        return self.target.lm_logits(h.to(self.target.dtype))[0]

    def propose(
        self,
        last_token: int,
        num_tokens: int,
        params: SamplingParams,
        generator: torch.Generator | None,
    ) -> DraftProposal:
        p = self._check_sync()
        self.tokens.append(last_token)
        drafts: list[int] = []
        logits, probs = [], []
        for i in range(num_tokens):
            row = self.draft_logits(p + i)
            token, dist = choose_token(row, params, generator)
            drafts.append(token)
            self.tokens.append(token)
            logits.append(row)
            if dist is not None:
                probs.append(dist)
        self._end_draft(p, last_token)
        return DraftProposal(
            tokens=drafts,
            logits=torch.stack(logits) if logits else torch.empty(0),
            probs=torch.stack(probs) if probs else None,
        )

    def propose_tree(self, last_token: int, depth: int, breadth: int, budget: int) -> DraftTree:
        """EAGLE-2 tree below `last_token` (see moa_tree); then state as after propose()."""
        p = self._check_sync()
        self.tokens.append(last_token)
        tree = MoATreeDrafter(self).draft(depth, breadth, budget)
        self._end_draft(p, last_token)
        return tree

    def catch_up(self, tokens: list[int], verified: TargetOutput) -> None:
        """Plainly decoded tokens: their memory rows in one LSA pass; their SA K/V is computed
        when the next draft step reaches them, as for every verified token."""
        if self._last_token is not None or len(self.tokens) != self.verified_len:
            raise RuntimeError("catch_up() called between propose() and accept()")
        if verified.layer_kv.shape[0] != len(tokens):
            raise ValueError(
                f"catch_up() needs one verified row per token: {len(tokens)} tokens, "
                f"{verified.layer_kv.shape[0]} rows"
            )
        self._extend_memory(verified)
        self.tokens.extend(tokens)

    def _check_sync(self) -> int:
        """The verified length p, after checking tokens, memory and target cache agree."""
        p = self.verified_len
        if len(self.tokens) != p or self.target.seq_len != p:
            raise RuntimeError(
                f"proposer out of sync: {len(self.tokens)} tokens, memory {p}, "
                f"target cache {self.target.seq_len}"
            )
        return p

    def _end_draft(self, p: int, last_token: int) -> None:
        del self.tokens[p:]  # only verified tokens stay; accept() appends what the target kept
        self._last_token = last_token
        if self.tli:
            self.target.crop(p)  # drop the TLI layers' draft K/V

    def accept(self, accepted: list[int], verified: TargetOutput) -> None:
        """`verified` holds the target rows of the last token and the accepted drafts."""
        if verified.layer_kv.shape[0] != len(accepted) + 1:
            raise ValueError(
                f"accept() needs {len(accepted) + 1} verified rows, "
                f"got {verified.layer_kv.shape[0]}"
            )
        if self._last_token is None:
            raise RuntimeError("accept() called without a preceding propose()")
        self._extend_memory(verified)
        self.tokens.extend([self._last_token, *accepted])
        self._last_token = None
        # SA K/V is valid where its input token was the accepted one: positions < verified_len.
        self.sa_cache.crop(len(self.tokens))
