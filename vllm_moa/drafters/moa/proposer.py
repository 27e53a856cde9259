"""Incremental MoA drafting for one sequence.

State between cycles (p = number of tokens the target has verified):
- CA memory: keys/values of rows 0..p-1. Each verified token goes through LSA exactly once,
  when its verification cycle ends (the prompt at prefill).
- SA KV cache: positions whose SA input is known to be right (verified tokens).
- tokens: the verified tokens 0..p-1.

A cycle drafts from the last token (position p, sampled by the target but not yet run through
it): SA over the pending tokens, CA over the memory, then TLI's target tail layers (their draft
K/V are cropped off the target cache afterwards) and the target's LM head (with a draft
vocabulary, only its rows of the draft tokens, gathered once: the logits of the other tokens
are -inf, so neither chains nor trees ever draft them). In a hierarchy
(hsd/hierarchy.py) the same step drafts after several unverified tokens (`draft_after`) or
scores a block of them in one pass (`score`), leaving this state as it was.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from vllm_moa.decoding.proposer import DraftProposal, draft_token, stack_proposal
from vllm_moa.decoding.sampling import SamplingParams
from vllm_moa.decoding.tree import DraftTree
from vllm_moa.decoding.tree_search import NodeKV, TreeSearch
from vllm_moa.drafters.moa.model import MoADrafter
from vllm_moa.hf_target.adapter import HFTarget, TargetOutput
from vllm_moa.model.kv_cache import KVCache
from vllm_moa.model.layers import masked_attention


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
        # Final hidden states [n, E] -> the drafts' logits [n, V] float32: the target's LM head,
        # or with a draft vocabulary its rows of the draft tokens (-inf at the others).
        ids = drafter.draft_ids
        self.lm_logits: Callable[[Tensor], Tensor] = (
            target.lm_logits if ids is None else target.vocab_head(ids)
        )

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
        h = self._draft_hidden(position, position)
        return self.lm_logits(h.to(self.target.dtype))[0]

    @torch.no_grad()
    def _draft_hidden(self, start: int, end: int) -> torch.Tensor:
        """The drafting step on positions start..end at once, each row seeing tokens up to its
        own (causal SA over the pending tokens, CA over the memory, then TLI's target layers):
        the final hidden states [end - start + 1, E] (LM head inputs). Needs the SA cache to
        hold no position past `start` and, with TLI, those layers' cache exactly positions
        < start (the verified ones, then this draft's earlier positions)."""
        first = self.sa_cache.length()
        device = self.target.device
        ids = torch.tensor(self.tokens[first : end + 1], device=device)
        positions = torch.arange(first, end + 1, device=device)
        emb = self.target.embed(ids).to(self.dtype)  # [n, E]
        before = start - first  # pending tokens before the first row: their SA K/V only
        if before > 0:
            k, v = self.drafter.self_attention.kv_from(emb[None, :before], positions[:before])
            self.sa_cache.update(k, v, 0)
        rows = positions[before:]
        # One row: it sees every cached key (all at positions <= it); more: causal among them.
        keys_at = torch.arange(end + 1, device=device)
        causal = None if len(rows) == 1 else keys_at[None, :] <= rows[:, None]  # [n, end + 1]

        def self_attend(q: torch.Tensor, k: Tensor | None, v: Tensor | None) -> torch.Tensor:
            assert k is not None and v is not None
            keys, values = self.sa_cache.update(k.transpose(0, 1)[None], v.transpose(0, 1)[None], 0)
            return rows_attention(q, keys, values, causal)

        def cross_attend(q: torch.Tensor, *_: Tensor | None) -> torch.Tensor:
            # Every memory row (< verified_len <= position) is visible to a drafted position.
            return rows_attention(q, *self.memory.get(0), None)

        h = self.drafter.draft_step(emb[before:], rows, self_attend, cross_attend)
        if self.tli:
            h = self.target.run_tail_layers(h, rows, self.tli)
        return h

    def propose(
        self,
        last_token: int,
        num_tokens: int,
        params: SamplingParams,
        generator: torch.Generator | None,
        forced: Sequence[int] = (),
    ) -> DraftProposal:
        p = self._check_sync()
        proposal = self._chain([last_token], num_tokens, params, generator, forced)
        self._end_draft(p, last_token)
        return proposal

    def draft_after(
        self,
        pending: list[int],
        num_tokens: int,
        params: SamplingParams,
        generator: torch.Generator | None,
    ) -> DraftProposal:
        """Drafts after the verified tokens and `pending` (a hierarchy's bottom level): the
        chain of propose(), from the pending tokens' positions; then the state as before."""
        p = self._check_sync()
        proposal = self._chain(pending, num_tokens, params, generator, ())
        self._restore(p)
        return proposal

    @torch.no_grad()
    def score(self, pending: list[int], tokens: list[int]) -> torch.Tensor:
        """Logits [n+1, V] after `pending` + tokens[:j] (a hierarchy's intermediate level): one
        SA + CA pass over the new positions (from p with TLI, whose layers need the pending
        positions' K/V too), the distributions drafting gives them (CA sees the memory of
        verified tokens only, as when drafting); then the state as before."""
        p = self._check_sync()
        self.tokens.extend([*pending, *tokens])
        last = p + len(pending) - 1  # the last pending token's position: the first row
        h = self._draft_hidden(p if self.tli else last, len(self.tokens) - 1)
        logits = self.lm_logits(h[-(len(tokens) + 1) :].to(self.target.dtype))
        self._restore(p)
        return logits

    def _chain(
        self,
        pending: list[int],
        num_tokens: int,
        params: SamplingParams,
        generator: torch.Generator | None,
        forced: Sequence[int],
    ) -> DraftProposal:
        """Draft num_tokens after the verified tokens + pending (appended to tokens; the caller
        restores them)."""
        p = self.verified_len
        self.tokens.extend(pending)
        last = len(self.tokens) - 1
        if self.tli and num_tokens and last > p:  # TLI layers' K/V at the other pending positions
            self._draft_hidden(p, last - 1)
        drafts: list[int] = []
        logits, probs = [], []
        for i in range(num_tokens):
            row = self.draft_logits(last + i)
            token, dist = draft_token(row, i, forced, params, generator)
            drafts.append(token)
            self.tokens.append(token)
            logits.append(row)
            if dist is not None:
                probs.append(dist)
        return stack_proposal(drafts, logits, probs)

    def _restore(self, p: int) -> None:
        """Back to the p verified tokens, with nothing drafted in the caches."""
        del self.tokens[p:]
        self.sa_cache.crop(p)
        if self.tli:
            self.target.crop(p)

    def propose_tree(self, last_token: int, depth: int, breadth: int, budget: int) -> DraftTree:
        """EAGLE-2 tree below `last_token` (the Trees section); then state as after propose()."""
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

    def withdraw(self) -> None:
        self.sa_cache.crop(len(self.tokens))  # the drafts' SA K/V
        self._last_token = None

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


# -- Trees -------------------------------------------------------------------------------------
#
# EAGLE-2 trees with the MoA drafter (one sequence; the search itself is `tree_search`).
#
# Each expanded candidate's SA query sees the verified prefix and its ancestors, its CA query sees
# every memory row (< p), and with TLI the target's last layers see their verified cache plus the
# root's and the ancestors' draft K/V (within each layer's sliding window, if it has one).


def rows_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
    """Queries [f, H, D] as the rows of one sequence, over k, v [1, Hkv, S, D] -> [f, H, D]."""
    return masked_attention(q.transpose(0, 1)[None], k, v, mask)[0].transpose(0, 1)


class MoATreeDrafter(TreeSearch):
    """The tree below the proposer's last token (already appended to its tokens, at position
    p = verified_len). Leaves the proposer's caches as they were before except for the root step
    (SA up to p; TLI draft K/V at p): MoAProposer.propose_tree cleans up."""

    def __init__(self, proposer: MoAProposer) -> None:
        super().__init__()
        self.prop = proposer

    def root(self) -> torch.Tensor:
        prop, target = self.prop, self.prop.target
        self.p = prop.verified_len
        logits = prop.draft_logits(self.p)  # SA cache now holds 0..p
        self.sa = NodeKV({0: prop.sa_cache.get(0)})
        tail = range(target.shape.num_layers - prop.tli, target.shape.num_layers)
        self.tail = NodeKV({i: target.cache.get(i) for i in tail})  # verified + root at p
        return logits

    def expand(self, frontier: list[int]) -> torch.Tensor:
        prop, target, p = self.prop, self.prop.target, self.p
        device = target.device
        ids, positions = self.inputs(frontier, p, device)
        emb = target.embed(ids).to(prop.dtype)  # [f, E]
        allowed = self.visible(frontier, p + 1).to(device)  # [f, S]: prefix and ancestors

        def self_attend(q: Tensor, k: Tensor | None, v: Tensor | None) -> Tensor:
            assert k is not None and v is not None
            keys, values = self.sa.update(k.transpose(0, 1)[None], v.transpose(0, 1)[None], 0)
            return rows_attention(q, keys, values, allowed)

        def cross_attend(q: Tensor, *_: Tensor | None) -> Tensor:
            return rows_attention(q, *prop.memory.get(0), None)

        h = prop.drafter.draft_step(emb, positions, self_attend, cross_attend)  # [f, E]
        if prop.tli:
            tail = range(target.shape.num_layers - prop.tli, target.shape.num_layers)
            keys = self.key_positions(p + 1, p).to(device)

            def mask_for(i: int) -> torch.Tensor:  # ancestors, within i's sliding window
                ok = allowed & target.causal_allowed(i, positions, keys)
                return target.additive_mask(ok)[None, None]

            h = target.run_layers(h[None].to(target.dtype), positions, tail, self.tail, mask_for)
            h = target.norm(h)[0]
        return prop.lm_logits(h.to(target.dtype))
