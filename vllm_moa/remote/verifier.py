"""The server's compute: one target, many client sessions, verification batched across them.

A session is one client's generation: its own target KV cache, sampling state and generated
tokens. `prefill` runs a prompt; `verify` runs one pass over every session whose drafts are in
(each draft a tree below the session's last token; a chain is a tree of one branch), verifies
each losslessly (greedy: the target's argmax path; sampling: each draft a point-mass proposal
accepted with the target's probability, which preserves the target's distribution whatever the
client drafted), and answers with the tokens and the activation rows the client's drafter needs.
Nothing here does I/O: `server.py` owns the sockets.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from vllm_moa.decoding.proposer import choose_token
from vllm_moa.decoding.sampling import SamplingParams, probabilities
from vllm_moa.decoding.tree import DraftTree, verify_tree_greedy, verify_tree_sampling
from vllm_moa.hf_target.adapter import HFTarget, TargetOutput, TreeInput
from vllm_moa.model.kv_cache import KVCache
from vllm_moa.remote import protocol
from vllm_moa.remote.protocol import Finish, ProtocolError, QTensor
from vllm_moa.remote.split import ServerHalf

MIN_TEMPERATURE = 1e-3


@dataclass
class Session:
    prompt_len: int
    max_new_tokens: int
    params: SamplingParams
    generator: torch.Generator
    cache: KVCache
    generated: list[int] = field(default_factory=list)
    cycle: int = 0  # the next DRAFT's expected cycle number
    finish: Finish = Finish.NONE
    last_active: float = field(default_factory=time.monotonic)

    @property
    def position(self) -> int:
        """Of the last generated token, which the target has not run yet."""
        return self.prompt_len + len(self.generated) - 1


class Verifier:
    def __init__(
        self,
        target: HFTarget,
        half: ServerHalf,
        fingerprint: bytes,
        eos_token_ids: list[int],
    ) -> None:
        self.target = target
        self.half = half
        self.fingerprint = fingerprint
        self.eos = set(eos_token_ids)
        self.passes = 0  # verification passes run
        self.sessions_verified = 0  # sessions served by them (their mean = the batch size)

    def open(self, start: protocol.Start) -> Session:
        """A new session for a START message; ProtocolError names what is unacceptable."""
        limit = self.target.max_length
        if start.fingerprint != self.fingerprint:
            raise ProtocolError(
                f"the client's drafter (fingerprint {start.fingerprint.hex()}) is not the "
                f"server's ({self.fingerprint.hex()}): give both the same --drafter directory",
                code=409,
            )
        if not start.prompt:
            raise ProtocolError("START carries an empty prompt")
        if len(start.prompt) >= limit:
            raise ProtocolError(
                f"prompt has {len(start.prompt)} tokens; the target's context is {limit}",
                code=413,
            )
        self._check_tokens(start.prompt, "prompt")
        if start.max_new_tokens < 1:
            raise ProtocolError("max_new_tokens must be >= 1")
        try:
            params = SamplingParams(start.temperature, start.top_p, start.top_k)
        except ValueError as e:
            raise ProtocolError(f"START: {e}") from None
        if 0 < start.temperature < MIN_TEMPERATURE:  # logits / T would overflow
            raise ProtocolError(
                f"START: temperature {start.temperature:g} is below {MIN_TEMPERATURE}; "
                "use 0 for greedy decoding"
            )
        gen = torch.Generator(device=self.target.device)
        gen.manual_seed(start.seed) if start.seed is not None else gen.seed()
        return Session(
            len(start.prompt), start.max_new_tokens, params, gen, KVCache(len(self.target.layers))
        )

    def _check_tokens(self, ids: list[int], what: str) -> None:
        vocab = self.target.shape.vocab_size
        bad = [t for t in ids if t >= vocab]
        if bad:
            raise ProtocolError(
                f"{what} token ids {bad[:5]} are outside the vocabulary [0, {vocab})"
            )

    def check_draft(self, session: Session, draft: protocol.Draft) -> None:
        """Before a draft is queued: in order, for an open session, within the context."""
        if session.finish is not Finish.NONE:
            raise ProtocolError(f"DRAFT after the response finished ({session.finish.reason})")
        if draft.cycle != session.cycle:
            raise ProtocolError(
                f"DRAFT out of order: cycle {draft.cycle}, expected {session.cycle}", code=409
            )
        self._check_tokens(draft.tokens, "draft")
        depth = max(
            DraftTree(draft.tokens, draft.parents, [0.0] * len(draft.tokens)).depths(), default=0
        )
        if session.position + depth >= self.target.max_length:
            raise ProtocolError(
                f"draft reaches position {session.position + depth}, beyond the target's "
                f"context of {self.target.max_length}"
            )

    @torch.no_grad()
    def prefill(self, session: Session, prompt: list[int]) -> protocol.Started:
        target = self.target
        target.cache = session.cache
        out = target.forward(torch.tensor(prompt), self.half.hidden_layers)
        token = choose_token(out.logits[-1], session.params, session.generator)[0]
        self._emit(session, [token])
        rows = self._payload([out], [torch.arange(len(prompt))])[0]
        session.last_active = time.monotonic()
        return protocol.Started(token, session.finish, rows)

    @torch.no_grad()
    def verify(
        self, batch: list[tuple[Session, protocol.Draft]]
    ) -> list[protocol.Verified | Exception]:
        """One target pass for every (session, draft) of the batch; a session whose
        verification failed gets its exception in place of its reply."""
        trees, inputs = [], []
        for session, draft in batch:
            tree = DraftTree(draft.tokens, draft.parents, [0.0] * len(draft.tokens))
            ids, positions, allowed = tree.verification_inputs(
                session.generated[-1], session.position
            )
            trees.append(tree)
            inputs.append(TreeInput(session.cache, ids, positions, allowed))
        hidden = self.half.hidden_layers
        if len(batch) == 1:
            self.target.cache = batch[0][0].cache
            i = inputs[0]
            outs = [self.target.forward_tree(i.token_ids, i.positions, i.allowed, hidden)]
        else:
            outs = self.target.forward_trees(inputs, hidden)
        self.passes += 1
        self.sessions_verified += len(batch)
        kept, kept_positions = [], []
        replies: list[protocol.Verified | Exception] = []
        for (session, draft), tree, out in zip(batch, trees, outs, strict=True):
            try:  # one session's failure is its own: the others' replies stand
                if session.params.greedy:
                    verdict = verify_tree_greedy(tree, out.logits)
                else:
                    probs = probabilities(out.logits, session.params)
                    verdict = verify_tree_sampling(tree, probs, session.generator)
            except Exception as e:  # its connection gets an ERROR and is closed
                replies.append(e)
                continue
            rows = [0] + [i + 1 for i in verdict.path]
            p = session.position
            session.cache.keep(p, [p + r for r in rows])
            accepted = [tree.tokens[i] for i in verdict.path]
            emitted = self._emit(session, [*accepted, verdict.next_token])
            kept.append(out.select(rows))
            kept_positions.append(torch.arange(p, p + len(rows)))
            replies.append(
                protocol.Verified(draft.cycle, emitted[:-1], emitted[-1], session.finish)
            )
            session.cycle += 1
            session.last_active = time.monotonic()
        served = [r for r in replies if isinstance(r, protocol.Verified)]
        for reply, rows_ in zip(served, self._payload(kept, kept_positions), strict=True):
            if reply.finish is Finish.NONE:  # a finished response needs no more drafting
                reply.rows = rows_
        return replies

    def _emit(self, session: Session, tokens: list[int]) -> list[int]:
        """Append tokens up to the first that finishes the response; returns those appended."""
        out = []
        for t in tokens:
            session.generated.append(t)
            out.append(t)
            n = len(session.generated)
            if t in self.eos:
                session.finish = Finish.EOS
            elif n >= session.max_new_tokens:
                session.finish = Finish.LENGTH
            elif session.prompt_len + n >= self.target.max_length:
                session.finish = Finish.CONTEXT
            if session.finish is not Finish.NONE:
                break
        return out

    def _payload(
        self, outs: list[TargetOutput], positions: list[torch.Tensor]
    ) -> list[list[QTensor]]:
        """The quantised activation rows for each output, computed in one drafter pass."""
        if not outs:
            return []
        joined = TargetOutput.concat(outs)
        device = self.target.device
        tensors = self.half.rows(joined, torch.cat(positions).to(device))
        sizes = [o.logits.shape[0] for o in outs]
        per_out: list[list[QTensor]] = [[] for _ in outs]
        for t in tensors:
            for i, part in enumerate(t.split(sizes)):
                per_out[i].append(QTensor.quantize(part))
        return per_out
