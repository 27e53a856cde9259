"""Incremental drafting with the independent drafter for one sequence, chains and EAGLE-2 trees."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from vllm_moa.decoding.proposer import DraftProposal, check_catch_up, draft_token, stack_proposal
from vllm_moa.decoding.sampling import SamplingParams
from vllm_moa.decoding.tree import DraftTree
from vllm_moa.decoding.tree_search import NodeKV, TreeSearch
from vllm_moa.drafters.independent.model import IndependentDrafter
from vllm_moa.hf_target.adapter import HFTarget, TargetOutput
from vllm_moa.model.kv_cache import KVCache
from vllm_moa.model.masks import causal_mask


class IndependentProposer:
    """A small LM drafting on its own; its KV stays valid wherever the drafts were accepted."""

    hidden_layers: tuple[int, ...] = ()

    def __init__(self, drafter: IndependentDrafter, target: HFTarget) -> None:
        drafter.config.check_target(target.shape)
        self.drafter = drafter.eval()
        self.target = target
        self.cache = KVCache(len(drafter.blocks))
        self.tokens: list[int] = []
        self._last_token: int | None = None

    def start(self, prompt_ids: list[int], prefill: TargetOutput) -> None:
        self.cache.reset()
        self.tokens = list(prompt_ids)
        self._last_token = None

    @torch.no_grad()
    def _logits(self, seq: list[int], rows: int = 1) -> torch.Tensor:
        """Feed seq[cached:] and return the logits after its last `rows` tokens, [rows, V]."""
        first, device = self.cache.length(), self.target.device
        positions = torch.arange(first, len(seq), device=device)
        h = self.target.embed(torch.tensor(seq[first:], device=device))[None]
        h = h.to(self.drafter.norm.weight.dtype)
        mask = causal_mask(positions, len(seq))
        for i, block in enumerate(self.drafter.blocks):
            k, v = self.cache.update(*block.kv_from(h, positions), i)
            h = block(h, positions, k, v, mask)
        last = self.drafter.norm(h[0, -rows:])
        return self.target.lm_logits(last.to(self.target.dtype))

    def propose(
        self,
        last_token: int,
        num_tokens: int,
        params: SamplingParams,
        gen: torch.Generator | None,
        forced: Sequence[int] = (),
    ) -> DraftProposal:
        proposal = self._chain([*self.tokens, last_token], num_tokens, params, gen, forced)
        self._last_token = last_token
        return proposal

    def draft_after(
        self,
        pending: list[int],
        num_tokens: int,
        params: SamplingParams,
        gen: torch.Generator | None,
    ) -> DraftProposal:
        """Drafts after the tokens and `pending` (a hierarchy's bottom level); then the cache
        holds the verified tokens' K/V only, as before."""
        proposal = self._chain([*self.tokens, *pending], num_tokens, params, gen, ())
        self.cache.crop(len(self.tokens))
        return proposal

    def score(self, pending: list[int], tokens: list[int]) -> torch.Tensor:
        """Logits [n+1, V] after `pending` + tokens[:j] (a hierarchy's intermediate level): one
        causal pass of the layers over the positions not cached; then the cache as before."""
        logits = self._logits([*self.tokens, *pending, *tokens], len(tokens) + 1)
        self.cache.crop(len(self.tokens))
        return logits

    def _chain(
        self,
        seq: list[int],
        num_tokens: int,
        params: SamplingParams,
        gen: torch.Generator | None,
        forced: Sequence[int],
    ) -> DraftProposal:
        seq = list(seq)
        drafts: list[int] = []
        logits, probs = [], []
        for i in range(num_tokens):
            row = self._logits(seq)[0]
            token, dist = draft_token(row, i, forced, params, gen)
            drafts.append(token)
            seq.append(token)
            logits.append(row)
            if dist is not None:
                probs.append(dist)
        return stack_proposal(drafts, logits, probs)

    def propose_tree(self, last_token: int, depth: int, breadth: int, budget: int) -> DraftTree:
        """EAGLE-2 tree below `last_token` (the Trees section); then state as after propose()."""
        tree = IndependentTreeDrafter(self, last_token).draft(depth, breadth, budget)
        self._last_token = last_token
        return tree

    def withdraw(self) -> None:
        self.cache.crop(len(self.tokens))  # the drafts' K/V
        self._last_token = None

    def accept(self, accepted: list[int], verified: TargetOutput) -> None:
        if self._last_token is None:
            raise RuntimeError("accept() called without a preceding propose()")
        self.tokens.extend([self._last_token, *accepted])
        self.cache.crop(len(self.tokens))  # drop K/V of rejected drafts
        self._last_token = None

    def catch_up(self, tokens: list[int], verified: TargetOutput) -> None:
        """Plainly decoded tokens; the next draft step runs them through the drafter."""
        check_catch_up(self._last_token, tokens, verified)
        self.tokens.extend(tokens)


# -- Trees -------------------------------------------------------------------------------------
#
# EAGLE-2 trees with the independent drafter (one sequence; the search itself is `tree_search`).
#
# A candidate is its token at position p + d, run through every layer. Its query sees the cached
# prefix and its ancestors among the expanded.


class IndependentTreeDrafter(TreeSearch):
    def __init__(self, proposer: IndependentProposer, last_token: int) -> None:
        super().__init__()
        self.prop = proposer
        self.last_token = last_token

    def root(self) -> torch.Tensor:
        prop = self.prop
        seq = [*prop.tokens, self.last_token]
        self.p = len(seq) - 1  # the last token's position; the cache now holds 0..p
        logits = prop._logits(seq)[0]
        self.kv = NodeKV({i: prop.cache.get(i) for i in range(len(prop.drafter.blocks))})
        return logits

    def expand(self, frontier: list[int]) -> torch.Tensor:
        prop, target, p = self.prop, self.prop.target, self.p
        device = target.device
        ids, positions = self.inputs(frontier, p, device)
        allowed = self.visible(frontier, p + 1).to(device)
        h = target.embed(ids)[None].to(prop.drafter.norm.weight.dtype)
        for i, block in enumerate(prop.drafter.blocks):
            k, v = self.kv.update(*block.kv_from(h, positions), i)
            h = block(h, positions, k, v, allowed)
        return target.lm_logits(prop.drafter.norm(h[0]).to(target.dtype))
