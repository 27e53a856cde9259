"""The device side of client-server speculative decoding (`vllm-moa remote-generate`).

The client holds the drafter's drafting half and the target parts it needs (`DeviceTarget`),
sends the prompt, then per cycle drafts a chain or an EAGLE-2 tree locally and sends it; the
server answers with the tokens it accepted, its next token and the activation rows that keep
the drafter in step. Drafts are the drafter's greedy (top-k for trees) choices at any
temperature: the server verifies them as point masses, which is lossless.

Chains are adaptive by default (`adaptive=False` or VLLM_MOA_ADAPTIVE=0: always K): each cycle
drafts as many tokens (0 included) as the measured acceptance and costs say pay, by the rule the
standalone engine and the vLLM plugin use (`vllm_moa/adaptive.py`'s `AdaptiveLengths`, kept by
the client across its calls as an engine keeps it). Here the verify step is the round trip to
the server (the network, the server's target pass, absorbing its rows), so a slow link makes
long chains pay and a useless drafter stops drafting. Trees are not adapted.

When the server becomes unreachable (an error on the socket, a timeout, or
`disconnect_after` tokens), the client finishes the response alone: the drafter continues from
everything verified so far (MoA keeps its CA memory of the verified prefix), sampling from its
own distribution at temperature > 0, and `disconnected_at` records how many tokens were generated
by then.
"""

from __future__ import annotations

import socket
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from vllm_moa.adaptive import (
    AdaptiveLengths,
    DraftGuard,
    OneRequest,
    StepCosts,
    adaptive_enabled,
)
from vllm_moa.checkpoint import load_drafter
from vllm_moa.checkpoint.io import drafter_dir_of, load_config
from vllm_moa.decoding.proposer import TreeProposer
from vllm_moa.decoding.sampling import SamplingParams
from vllm_moa.decoding.tree import DraftTree, TreeParams
from vllm_moa.kinds import kind_of
from vllm_moa.remote import protocol
from vllm_moa.remote.device_target import DeviceTarget
from vllm_moa.remote.protocol import Finish, QTensor
from vllm_moa.remote.split import client_proposer, fingerprint, split_of

GREEDY = SamplingParams()


class RemoteError(OSError):
    """The server refused a request (its ERROR message, with its code)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(f"server error {code}: {message}")
        self.code = code


@dataclass
class RemoteResult:
    token_ids: list[int]
    finish_reason: str  # eos | length | context
    server_calls: int  # round trips: the prompt and each draft
    bytes_up: int  # framed bytes sent
    bytes_down: int  # framed bytes received
    cycles: int  # verification cycles
    accepted_tokens: int  # drafts the server accepted
    wall_time_s: float
    disconnected_at: int | None  # tokens generated when the server was lost; None if never
    reconnections: int = 0  # times the server was reached again after a loss
    drafted_tokens: int = 0  # drafts sent for verification

    @property
    def mean_accepted_length(self) -> float:
        """tau: tokens per verification cycle (accepted drafts + the server's token)."""
        return 1.0 + self.accepted_tokens / self.cycles if self.cycles else 1.0

    @property
    def tokens_per_second(self) -> float:
        return len(self.token_ids) / self.wall_time_s if self.wall_time_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["mean_accepted_length"] = self.mean_accepted_length
        out["tokens_per_second"] = self.tokens_per_second
        return out


def parse_address(server: str) -> tuple[str, int]:
    host, sep, port = server.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"--server must be HOST:PORT, got {server!r}")
    return host.strip("[]"), int(port)


def _is_path(draft: DraftTree, accepted: list[int]) -> bool:
    """Whether `accepted` follows the draft tree down from the root (the server accepts drafted
    tokens only)."""
    node = -1
    for token in accepted:
        match = [c for c in draft.children(node) if draft.tokens[c] == token]
        if not match:
            return False
        node = match[0]
    return True


class _Link:
    """The blocking socket, with byte counts. Any failure -> ConnectionError."""

    def __init__(self, address: tuple[str, int], timeout: float) -> None:
        self.sock = socket.create_connection(address, timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.up = self.down = self.calls = 0

    def call(self, message: protocol.Message) -> protocol.Message:
        data = protocol.frame(message)
        try:
            self.sock.sendall(data)
            self.up += len(data)
            self.calls += 1
            reply = protocol.recv_frame(self.sock)
            self.down += len(reply) + 4
            answer = protocol.decode(reply)
        except (OSError, protocol.ProtocolError) as e:  # timeouts are OSErrors
            raise ConnectionError(str(e)) from e
        if isinstance(answer, protocol.Error):
            raise RemoteError(answer.code, answer.message)
        return answer

    def close(self, polite: bool) -> None:
        try:
            if polite:
                data = protocol.frame(protocol.Close())
                self.sock.sendall(data)
                self.up += len(data)
            self.sock.close()
        except OSError:
            pass


@dataclass
class _Run:
    """One generate() call's state across links."""

    prompt: list[int]
    max_new_tokens: int
    eos: set[int]
    context: int  # the target's max length
    began: float
    generated: list[int] = field(default_factory=list)  # verified by the server
    finish: Finish = Finish.NONE
    cycle: int = 0  # the current session's next DRAFT number
    cycles: int = 0
    accepted: int = 0
    calls: int = 0
    up: int = 0
    down: int = 0
    reconnections: int = 0
    disconnected_at: int | None = None
    drafted: int = 0
    policy: OneRequest | None = None  # adaptive chains: the client's rule, this call's tracker

    def length(self) -> int:
        return len(self.prompt) + len(self.generated)

    def room(self) -> int:
        """Tokens still allowed after the generated ones."""
        return self.max_new_tokens - len(self.generated)

    def absorb_link(self, link: _Link) -> None:
        self.calls, self.up, self.down = (
            self.calls + link.calls,
            self.up + link.up,
            self.down + link.down,
        )
        link.calls = link.up = link.down = 0

    def finished_alone(self, local: list[int]) -> str | None:
        """Why the response ends within `local` (cut there), or None."""
        text = self.generated + local
        for i in range(len(self.generated), len(text)):
            if text[i] in self.eos:
                del local[i - len(self.generated) + 1 :]
                return "eos"
        if self.generated and self.generated[-1] in self.eos:
            return "eos"
        if len(text) >= self.max_new_tokens:
            return "length"
        if len(self.prompt) + len(text) >= self.context - 1:  # as far as the device writes
            return "context"
        return None

    def finish_alone(self, local: list[int]) -> str:
        """Take `local` as the end of the response; why it ends."""
        reason = self.finished_alone(local)
        self.generated += local
        if reason is not None:
            return reason
        return "length" if len(self.generated) >= self.max_new_tokens else "context"

    def result(self, reason: str) -> RemoteResult:
        return RemoteResult(
            token_ids=self.generated,
            finish_reason=reason,
            server_calls=self.calls,
            bytes_up=self.up,
            bytes_down=self.down,
            cycles=self.cycles,
            accepted_tokens=self.accepted,
            wall_time_s=time.perf_counter() - self.began,
            disconnected_at=self.disconnected_at,
            reconnections=self.reconnections,
            drafted_tokens=self.drafted,
        )


@dataclass
class RemoteClient:
    def __init__(
        self,
        server: str,
        target_dir: str | Path,
        drafter_dir: str | Path,
        dtype: torch.dtype = torch.float32,
        device: str = "cpu",
        timeout_s: float = 30.0,
    ) -> None:
        self.address = parse_address(server)
        drafter_dir = drafter_dir_of(drafter_dir)
        self.tli = int(getattr(load_config(drafter_dir), "tli", 0))
        self.target = DeviceTarget.load(target_dir, self.tli, dtype, device)
        drafter = load_drafter(drafter_dir, self.target.shape, dtype=dtype, device=device)
        self.kind = kind_of(drafter).name
        self.split = split_of(self.kind)  # what the server's rows hold
        self.proposer = client_proposer(drafter, self.target)
        self.fingerprint = fingerprint(drafter_dir)
        self.timeout_s = timeout_s
        self.adaptive_lengths: dict[int, AdaptiveLengths] = {}  # by K, kept across calls
        self.row_shapes: list[tuple[int, ...]] = []  # per row tensor [...], from STARTED

    @torch.no_grad()
    def generate(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        params: SamplingParams | None = None,
        *,
        num_speculative_tokens: int = 4,
        tree: TreeParams | None = None,
        seed: int | None = None,
        eos_token_ids: list[int] | tuple[int, ...] = (),
        disconnect_after: int | None = None,
        reconnect_every: int | None = None,
        private_suffix: list[int] | tuple[int, ...] = (),
        adaptive: bool = True,
    ) -> RemoteResult:
        """Speculative decoding against the server. `disconnect_after` B: leave the server once
        B tokens are out and finish alone. `reconnect_every` N: after a lost link, write N tokens
        alone at a time and try to reconnect between them; once back, the server verifies what
        was written alone (one draft) and decoding goes on, so the output stays lossless.
        `private_suffix`: prompt tokens the server never sees (the paper's appendix A.6): the
        server runs only `prompt_ids`, and the device writes the whole response with its
        drafter, over the prefix's activations and the private suffix. `adaptive`: chain
        lengths chosen per cycle (unless VLLM_MOA_ADAPTIVE=0; trees and seeded sampled requests
        keep K)."""
        params = params or SamplingParams()
        if tree is not None and not isinstance(self.proposer, TreeProposer):
            raise ValueError(f"a {self.kind} drafter does not draft trees")
        if reconnect_every is not None and reconnect_every < 1:
            raise ValueError(f"reconnect_every must be >= 1, got {reconnect_every}")
        run = _Run(
            list(prompt_ids),
            max_new_tokens,
            set(eos_token_ids),
            self.target.max_length,
            time.perf_counter(),
        )
        # A seeded sampled request keeps the fixed K: the server's random draws follow the
        # drafts, and adaptive lengths follow measured times, so its text would not repeat.
        seeded_sampling = seed is not None and not params.greedy
        if adaptive and adaptive_enabled() and tree is None and not seeded_sampling:
            k = num_speculative_tokens
            lengths = self.adaptive_lengths.get(k)
            if lengths is None:
                lengths = AdaptiveLengths(k, StepCosts(cold_phases=1), guard=DraftGuard())
                self.adaptive_lengths[k] = lengths
            run.policy = OneRequest.of(lengths)
        gen = torch.Generator(device=self.target.device)
        gen.manual_seed(seed) if seed is not None else gen.seed()
        try:
            link = _Link(self.address, self.timeout_s)
        except OSError as e:
            host, port = self.address
            raise ConnectionError(f"cannot reach the server at {host}:{port}: {e}") from None
        self._open(link, run, params, seed)  # no local fallback before the prompt's rows arrive
        if private_suffix:
            link.close(polite=True)
            run.absorb_link(link)
            return self._private(run, list(private_suffix), params, gen)
        while True:
            lost = self._speculate(link, run, num_speculative_tokens, tree, disconnect_after)
            run.absorb_link(link)
            if not lost:
                return run.result(run.finish.reason or "length")
            if run.disconnected_at is None:
                run.disconnected_at = len(run.generated)
            if reconnect_every is None or disconnect_after is not None:
                alone = self._write_alone(run, [], run.room(), params, gen)
                return run.result(run.finish_alone(alone))
            local: list[int] = []
            while True:  # alone, trying to get the server back between chunks
                before = len(local)
                local = self._write_alone(run, local, reconnect_every, params, gen)
                reason = run.finished_alone(local)
                if reason is None and len(local) == before:  # no room left to write
                    reason = "context"
                if reason is not None:
                    run.generated += local
                    return run.result(reason)
                try:
                    link = _Link(self.address, self.timeout_s)
                except OSError:  # still unreachable
                    continue
                try:
                    lost_again = self._resume(link, run, local, params, seed)
                except ConnectionError:  # lost again before anything changed
                    link.close(polite=False)
                    run.absorb_link(link)
                    continue
                if lost_again is not None:
                    run.absorb_link(link)
                    local = lost_again
                    continue
                run.reconnections += 1
                break

    def _open(self, link: _Link, run: _Run, params: SamplingParams, seed: int | None) -> None:
        """START a session over the prompt and everything verified so far; the link is closed
        if that fails (the caller raises or retries)."""
        try:
            self._start(link, run, params, seed)
        except BaseException:
            link.close(polite=False)
            raise

    def _start(self, link: _Link, run: _Run, params: SamplingParams, seed: int | None) -> None:
        context = run.prompt + run.generated
        if seed is not None and run.generated:  # a resumed session: fresh random numbers
            seed = (seed + 1_000_003 * len(run.generated)) % (1 << 62)
        start = protocol.Start(
            context,
            run.max_new_tokens - len(run.generated),
            self.fingerprint,
            params.temperature,
            params.top_p,
            params.top_k,
            seed,
        )
        reply = link.call(start)
        if not isinstance(reply, protocol.Started):
            raise ConnectionError(f"expected STARTED, got {type(reply).__name__}")
        self._check_tokens([reply.first_token])
        self._check_rows(reply.rows, len(context))  # before the state it would replace goes
        self.target.reset()
        try:  # rows of the wrong width fail deep inside: name the reply instead
            self._absorb(reply.rows, len(context), start=context)
        except (ValueError, RuntimeError) as e:
            raise ConnectionError(f"the server's STARTED rows do not fit this drafter: {e}") from e
        self.row_shapes = [tuple(r.values.shape[1:]) for r in reply.rows]
        run.generated.append(reply.first_token)
        run.finish = reply.finish
        run.cycle = 0

    def _resume(
        self, link: _Link, run: _Run, local: list[int], params: SamplingParams, seed: int | None
    ) -> list[int] | None:
        """Back online: a new session over the verified text, then what was written alone
        goes to the server as one draft chain (its first token is checked against STARTED's).
        None once the server has it; if the link dies again meanwhile, what is still
        unverified of `local`."""
        self._open(link, run, params, seed)  # a failure here changes nothing
        if run.finish is not Finish.NONE or not local or run.generated[-1] != local[0]:
            return None
        rest = local[1:]
        draft = rest[: min(protocol.MAX_TREE_NODES, run.room() - 1)]
        if not draft:
            return None
        self.proposer.propose(run.generated[-1], 0, GREEDY, None)  # accept() follows
        try:
            self._verify(
                link, run, DraftTree(draft, list(range(-1, len(draft) - 1)), [0.0] * len(draft))
            )
        except ConnectionError:
            self.proposer.withdraw()
            link.close(polite=False)
            return rest
        return None

    def _speculate(
        self,
        link: _Link,
        run: _Run,
        k: int,
        tree: TreeParams | None,
        disconnect_after: int | None,
    ) -> bool:
        """Cycles until the response finishes (False) or the server is gone (True)."""
        while run.finish is Finish.NONE:
            if disconnect_after is not None and len(run.generated) >= disconnect_after:
                link.close(polite=True)
                return True
            position = len(run.prompt) + len(run.generated) - 1
            policy = run.policy
            budget = min(k, run.room() - 1, self.target.max_length - position - 2)
            chosen = policy.choose(budget) if policy is not None and budget >= 1 else k
            began = time.perf_counter()
            draft = self._draft(run.generated[-1], position, run.room(), chosen, tree)
            drafted = time.perf_counter()
            accepted_before = run.accepted
            try:
                self._verify(link, run, draft)
            except ConnectionError:
                self.proposer.withdraw()  # the draft in flight will never be verified
                link.close(polite=False)
                return True
            if policy is not None and budget >= 1 and run.finish is Finish.NONE:
                n, verify_s = len(draft.tokens), time.perf_counter() - drafted
                costs = policy.lengths.costs
                costs.observe_verify(n + 1, verify_s)  # the round trip and the server's rows
                costs.observe_draft(n, drafted - began)  # on the device
                policy.observe(n, run.accepted - accepted_before, verify_s + drafted - began,
                               probe_cost=drafted - began)  # fmt: skip
        link.close(polite=True)
        return False

    def _verify(self, link: _Link, run: _Run, draft: DraftTree) -> None:
        """One cycle's round trip; the link is closed if it fails (a lost server, a bad reply or
        the server's ERROR, which ends the response)."""
        try:
            self._round_trip(link, run, draft)
        except BaseException:
            link.close(polite=False)
            raise

    def _round_trip(self, link: _Link, run: _Run, draft: DraftTree) -> None:
        answer = link.call(protocol.Draft(run.cycle, draft.tokens, draft.parents))
        if not isinstance(answer, protocol.Verified) or answer.cycle != run.cycle:
            cycle = getattr(answer, "cycle", None)
            raise ConnectionError(
                f"expected VERIFIED for cycle {run.cycle}, got {type(answer).__name__}"
                + (f" for cycle {cycle}" if cycle is not None else "")
            )
        # Checked before anything of the cycle is taken. The next token is the server's word
        # (the client holds no full target to check it): only its range is checked.
        self._check_tokens([*answer.accepted, answer.next_token])
        if not _is_path(draft, answer.accepted):
            raise ConnectionError(
                f"the server accepted {answer.accepted}, not a path of the {len(draft.tokens)} "
                "drafted tokens"
            )
        if answer.finish is Finish.NONE:
            self._check_rows(answer.rows, len(answer.accepted) + 1, self.row_shapes)
        run.generated.extend([*answer.accepted, answer.next_token])
        run.drafted += len(draft.tokens)
        run.cycle += 1
        run.cycles += 1
        run.accepted += len(answer.accepted)
        run.finish = answer.finish
        if run.finish is Finish.NONE:
            self._absorb(answer.rows, len(answer.accepted) + 1, accepted=answer.accepted)

    def _write_alone(
        self, run: _Run, local: list[int], more: int, params: SamplingParams, gen: torch.Generator
    ) -> list[int]:
        """`local` (tokens written alone after the verified ones) and up to `more` after them.
        The drafter restarts from its verified state each time, with `local` forced."""
        if run.generated[-1] in run.eos:
            return local
        n = min(len(local) + more, run.room(), self.target.max_length - run.length() - 1)
        if n <= len(local):
            return local
        tokens = self.proposer.propose(run.generated[-1], n, params, gen, forced=local).tokens
        self.proposer.withdraw()  # never verified: the next chunk starts from the same state
        return tokens

    def _private(
        self, run: _Run, private: list[int], params: SamplingParams, gen: torch.Generator
    ) -> RemoteResult:
        """The response to prompt + private suffix, written on the device: the server only
        ever saw (and answered with the activations of) the prompt."""
        run.generated = []  # the server's token continued the prompt alone: not the response
        room = min(run.max_new_tokens, self.target.max_length - len(run.prompt) - len(private))
        if room < 1:
            raise ValueError("no room left in the target's context after the private suffix")
        forced = private[1:]
        proposal = self.proposer.propose(private[0], len(forced) + room, params, gen, forced=forced)
        self.proposer.withdraw()
        local = proposal.tokens[len(forced) :]
        run.disconnected_at = 0
        run.prompt = run.prompt + private
        return run.result(run.finish_alone(local))

    def _draft(
        self, last: int, position: int, left: int, k: int, tree: TreeParams | None
    ) -> DraftTree:
        """This cycle's draft below `last` (at `position`), as a tree (a chain: one branch)."""
        room = min(left - 1, self.target.max_length - position - 2)
        if room < 1:  # the last token: no drafts, the server's next token only
            self.proposer.propose(last, 0, GREEDY, None)
            return DraftTree([], [], [])
        if tree is not None:
            assert isinstance(self.proposer, TreeProposer)
            depth = min(tree.depth, room)
            drafted = self.proposer.propose_tree(
                last, depth, tree.breadth, min(tree.budget, protocol.MAX_TREE_NODES)
            )
            return drafted
        proposal = self.proposer.propose(last, min(k, room), GREEDY, None)
        n = len(proposal.tokens)
        return DraftTree(proposal.tokens, list(range(-1, n - 1)), [0.0] * n)

    def _check_rows(
        self, rows: list[QTensor], n: int, shapes: list[tuple[int, ...]] | None = None
    ) -> None:
        """`shapes`: each tensor's shape past its rows, as STARTED's were (None: not checked)."""
        want = self.split.expected_rows(self.tli)
        if len(rows) != want or any(r.rows != n for r in rows):
            raise ConnectionError(
                f"the server sent {len(rows)} activation tensors, expected {want} of {n} rows"
            )
        got = [tuple(r.values.shape[1:]) for r in rows]
        if shapes is not None and got != shapes:
            raise ConnectionError(f"the server sent rows of shapes {got}, expected {shapes}")

    def _check_tokens(self, tokens: list[int]) -> None:
        vocab = self.target.shape.vocab_size
        bad = [t for t in tokens if t >= vocab]
        if bad:
            raise ConnectionError(
                f"the server sent token ids {bad[:5]} outside the vocabulary [0, {vocab})"
            )

    def _absorb(
        self,
        rows: list[QTensor],
        n: int,
        start: list[int] | None = None,
        accepted: list[int] | None = None,
    ) -> None:
        """The server's rows for n verified tokens (checked by the caller, `_check_rows`,
        before anything of the cycle was taken) into the target parts and the proposer."""
        tensors = [r.dequantize(self.target.dtype) for r in rows]
        tail = tensors[1] if self.tli else None
        self.target.append_verified(n, tail)
        out = self.split.client_output(self.target.shape.num_layers, tensors, n)
        if start is not None:
            self.proposer.start(start, out)
        else:
            assert accepted is not None
            self.proposer.accept(accepted, out)
