"""Incremental EAGLE drafting for one sequence, chains and EAGLE-2 trees (GRIFFIN's too)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from vllm_moa.decoding.proposer import DraftProposal, check_catch_up, draft_token, stack_proposal
from vllm_moa.decoding.sampling import SamplingParams
from vllm_moa.decoding.tree import DraftTree
from vllm_moa.decoding.tree_search import NodeKV, TreeSearch
from vllm_moa.drafters.eagle.model import EagleDrafter
from vllm_moa.hf_target.adapter import HFTarget, TargetOutput
from vllm_moa.model.kv_cache import KVCache


class EagleProposer:
    """EAGLE drafting: input i = (x_{i+1}, f_i). The layer's KV cache holds only positions whose
    feature was the target's true one; drafted positions (predicted features) are recomputed
    after each verification. Written against the drafter's `fuse` and `heads`, so it drafts
    with GRIFFIN's drafter too."""

    def __init__(self, drafter: EagleDrafter, target: HFTarget) -> None:
        drafter.config.check_target(target.shape)
        self.drafter = drafter.eval()
        self.target = target
        self.hidden_layers: tuple[int, ...] = drafter.feature_layers()
        self.cache = KVCache(1)
        self.tokens: list[int] = []
        self.features = torch.empty(0)  # [p, E]: the drafter's features of the target's states
        self._last_token: int | None = None

    @property
    def dtype(self) -> torch.dtype:
        return self.drafter.fc.weight.dtype

    def start(self, prompt_ids: list[int], prefill: TargetOutput) -> None:
        self.cache.reset()
        self.tokens = list(prompt_ids)
        self.features = self._features(prefill)
        self._last_token = None

    @torch.no_grad()
    def _features(self, verified: TargetOutput) -> torch.Tensor:
        """[n, E]: the features of verified positions (`EagleDrafter.target_features`)."""
        return self.drafter.target_features(verified.hidden_states)

    def _target_head(self, states: torch.Tensor) -> torch.Tensor:
        return self.target.lm_logits(states.to(self.target.dtype))

    @torch.no_grad()
    def logits(self, states: torch.Tensor) -> torch.Tensor:
        """[..., V] logits of LM-head states (`EagleDrafter.logits`)."""
        return self.drafter.logits(states, self._target_head)

    @torch.no_grad()
    def _step(
        self, first: int, next_ids: list[int], features: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run positions first.. with inputs (x_{i+1}, f_i); return the last output's heads:
        (the state the LM head reads, the predicted feature), each [E]."""
        device = self.target.device
        positions = torch.arange(first, first + len(next_ids), device=device)
        emb = self.target.embed(torch.tensor(next_ids, device=device)).to(self.dtype)
        x = self.drafter.fuse(emb[None], features.to(self.dtype)[None])
        layer = self.drafter.layer
        k, v = self.cache.update(*layer.kv_from(x, positions), 0)
        return self.drafter.heads(layer(x[:, -1:], positions[-1:], k, v, None)[0, -1])

    def propose(
        self,
        last_token: int,
        num_tokens: int,
        params: SamplingParams,
        gen: torch.Generator | None,
        forced: Sequence[int] = (),
    ) -> DraftProposal:
        p = len(self.tokens)
        proposal = self._chain([last_token], num_tokens, params, gen, forced)
        self.cache.crop(p)  # positions >= p used predicted features
        self._last_token = last_token
        return proposal

    def draft_after(
        self,
        pending: list[int],
        num_tokens: int,
        params: SamplingParams,
        gen: torch.Generator | None,
    ) -> DraftProposal:
        """Drafts after the tokens and `pending` (a hierarchy's bottom level), the pending
        positions on predicted features as when drafting; then the cache as before."""
        proposal = self._chain(pending, num_tokens, params, gen, ())
        self.cache.crop(max(0, len(self.tokens) - 1))  # position p-1's input holds pending[0]
        return proposal

    @torch.no_grad()
    def score(self, pending: list[int], tokens: list[int]) -> torch.Tensor:
        """Logits [n+1, V] after `pending` + tokens[:j] (a hierarchy's intermediate level): the
        distributions drafting gives them. Each position's input is the feature predicted at
        the one before (no target feature exists past the verified tokens), so the layer runs
        one position at a time, as when drafting; the LM head runs once on all n+1 states."""
        state, predicted = self._predict(pending)
        states = [state]
        at = len(self.tokens) + len(pending) - 1  # the last pending token's position
        for i, token in enumerate(tokens):
            state, predicted = self._step(at + i, [token], predicted[None])
            states.append(state)
        self.cache.crop(max(0, len(self.tokens) - 1))
        return self.logits(torch.stack(states))

    def _predict(self, pending: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The heads [E] (LM-head state, predicted feature) at the last pending position: the
        uncached verified positions on the target's features, then each further pending token
        on the feature predicted before it."""
        p, first = len(self.tokens), self.cache.length()
        seq = [*self.tokens, pending[0]]
        state, predicted = self._step(first, seq[first + 1 : p + 1], self.features[first:p])
        for j, token in enumerate(pending[1:]):  # input p+j: (pending[j+1], predicted f_{p+j})
            state, predicted = self._step(p + j, [token], predicted[None])
        return state, predicted

    def _chain(
        self,
        pending: list[int],
        num_tokens: int,
        params: SamplingParams,
        gen: torch.Generator | None,
        forced: Sequence[int],
    ) -> DraftProposal:
        state, predicted = self._predict(pending)
        at = len(self.tokens) + len(pending) - 1
        drafts: list[int] = []
        logits, probs = [], []
        for i in range(num_tokens):
            row = self.logits(state[None])[0]
            token, dist = draft_token(row, i, forced, params, gen)
            drafts.append(token)
            logits.append(row)
            if dist is not None:
                probs.append(dist)
            if i + 1 < num_tokens:  # position at+i: (draft token, predicted feature)
                state, predicted = self._step(at + i, [token], predicted[None])
        return stack_proposal(drafts, logits, probs)

    def propose_tree(self, last_token: int, depth: int, breadth: int, budget: int) -> DraftTree:
        """EAGLE-2 tree below `last_token` (the Trees section); then state as after propose()."""
        tree = EagleTreeDrafter(self, last_token).draft(depth, breadth, budget)
        self._last_token = last_token
        return tree

    def withdraw(self) -> None:
        # propose() kept positions < p, but not the output at p-1 the next draft starts from.
        self.cache.crop(max(0, len(self.tokens) - 1))
        self._last_token = None

    def accept(self, accepted: list[int], verified: TargetOutput) -> None:
        if self._last_token is None:
            raise RuntimeError("accept() called without a preceding propose()")
        self.features = torch.cat([self.features, self._features(verified)])
        self.tokens.extend([self._last_token, *accepted])
        self._last_token = None

    def catch_up(self, tokens: list[int], verified: TargetOutput) -> None:
        """Plainly decoded tokens and their features; the next draft step runs them."""
        check_catch_up(self._last_token, tokens, verified)
        self.features = torch.cat([self.features, self._features(verified)])
        self.tokens.extend(tokens)


# -- Trees -------------------------------------------------------------------------------------
#
# EAGLE-2 trees with the EAGLE drafter (one sequence; the search itself is `tree_search`).
#
# A candidate at depth d (token at position p + d) is the layer input (its token, its parent's
# predicted feature) at position p + d - 1 (the root's children take the root step's predicted
# feature); its output is its own predicted feature, from which its children are read. Its query
# sees the cached prefix and its ancestors among the expanded.


class EagleTreeDrafter(TreeSearch):
    def __init__(self, proposer: EagleProposer, last_token: int) -> None:
        super().__init__()
        self.prop = proposer
        self.last_token = last_token
        self.features: dict[int, torch.Tensor] = {}  # expanded candidate -> predicted feature

    def root(self) -> torch.Tensor:
        prop = self.prop
        self.p, first = len(prop.tokens), prop.cache.length()
        seq = [*prop.tokens, self.last_token]
        # positions first..p-1 with true features (kept in the proposer's cache)
        state, self.root_feature = prop._step(
            first, seq[first + 1 : self.p + 1], prop.features[first : self.p]
        )
        self.kv = NodeKV({0: prop.cache.get(0)})
        return prop.logits(state[None])[0]

    def expand(self, frontier: list[int]) -> torch.Tensor:
        prop, target, p = self.prop, self.prop.target, self.p
        device = target.device
        ids, positions = self.inputs(frontier, p - 1, device)
        parents = torch.stack([self._parent_feature(c) for c in frontier])
        emb = target.embed(ids).to(prop.dtype)
        x = prop.drafter.fuse(emb[None], parents.to(prop.dtype)[None])  # [1, f, E]
        layer = prop.drafter.layer
        k, v = self.kv.update(*layer.kv_from(x, positions), 0)
        allowed = self.visible(frontier, p).to(device)
        states, features = prop.drafter.heads(layer(x, positions, k, v, allowed)[0])  # [f, E]
        for r, c in enumerate(frontier):
            self.features[c] = features[r]
        return prop.logits(states)

    def _parent_feature(self, candidate: int) -> torch.Tensor:
        parent = self.parent[candidate]
        return self.root_feature if parent < 0 else self.features[parent]
