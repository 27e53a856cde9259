"""The device side of client-server speculative decoding (`vllm-moa remote-generate`).

The client holds the drafter's drafting half and the target parts it needs (`DeviceTarget`),
sends the prompt, then per cycle drafts a chain or an EAGLE-2 tree locally and sends it; the
server answers with the tokens it accepted, its next token and the activation rows that keep
the drafter in step. Drafts are the drafter's greedy (top-k for trees) choices at any
temperature: the server verifies them as point masses, which is lossless.

When the server becomes unreachable (an error on the socket, a timeout, or
`disconnect_after` tokens), the client finishes the response alone: the drafter continues from
everything verified so far (MoA keeps its CA memory of the verified prefix), sampling from its
own distribution at temperature > 0, and `disconnected_at` records how many tokens were generated
by then.
"""

from __future__ import annotations

import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from vllm_moa.checkpoint import load_drafter
from vllm_moa.checkpoint.io import drafter_dir_of, load_config
from vllm_moa.decoding.proposer import TreeProposer
from vllm_moa.decoding.sampling import SamplingParams
from vllm_moa.decoding.tree import DraftTree, TreeParams
from vllm_moa.remote import protocol
from vllm_moa.remote.device_target import DeviceTarget
from vllm_moa.remote.protocol import Finish, QTensor
from vllm_moa.remote.split import (
    client_output,
    client_proposer,
    drafter_kind,
    expected_rows,
    fingerprint,
)

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
        except (OSError, protocol.ProtocolError) as e:  # timeouts are OSErrors
            raise ConnectionError(str(e)) from e
        self.down += len(reply) + 4
        answer = protocol.decode(reply)
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
        self.kind = drafter_kind(drafter)
        self.proposer = client_proposer(drafter, self.target)
        self.fingerprint = fingerprint(drafter_dir)
        self.timeout_s = timeout_s

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
    ) -> RemoteResult:
        params = params or SamplingParams()
        if tree is not None and not isinstance(self.proposer, TreeProposer):
            raise ValueError(f"a {self.kind} drafter does not draft trees")
        t0 = time.perf_counter()
        try:
            link = _Link(self.address, self.timeout_s)
        except OSError as e:
            host, port = self.address
            raise ConnectionError(f"cannot reach the server at {host}:{port}: {e}") from None
        start = protocol.Start(
            list(prompt_ids),
            max_new_tokens,
            self.fingerprint,
            params.temperature,
            params.top_p,
            params.top_k,
            seed,
        )
        reply = link.call(start)  # no local fallback before the prompt's activations arrive
        if not isinstance(reply, protocol.Started):
            raise RemoteError(400, f"expected STARTED, got {type(reply).__name__}")
        self.target.reset()
        self._absorb(reply.rows, len(prompt_ids), start=list(prompt_ids))
        generated = [reply.first_token]
        finish = reply.finish
        cycles = accepted_total = 0
        disconnected_at: int | None = None
        gen = torch.Generator(device=self.target.device)
        gen.manual_seed(seed) if seed is not None else gen.seed()
        while finish is Finish.NONE:
            if disconnect_after is not None and len(generated) >= disconnect_after:
                link.close(polite=True)
                disconnected_at = len(generated)
                break
            last = generated[-1]
            draft = self._draft(
                last,
                len(prompt_ids) + len(generated) - 1,
                max_new_tokens - len(generated),
                num_speculative_tokens,
                tree,
            )
            try:
                answer = link.call(protocol.Draft(cycles, draft.tokens, draft.parents))
            except ConnectionError:
                self.proposer.withdraw()  # the draft in flight will never be verified
                disconnected_at = len(generated)
                break
            if not isinstance(answer, protocol.Verified) or answer.cycle != cycles:
                raise RemoteError(400, f"unexpected reply {type(answer).__name__}")
            emitted = [*answer.accepted, answer.next_token]
            generated.extend(emitted)
            cycles += 1
            accepted_total += len(answer.accepted)
            finish = answer.finish
            if finish is Finish.NONE:
                self._absorb(answer.rows, len(answer.accepted) + 1, accepted=answer.accepted)
        if disconnected_at is None:
            link.close(polite=True)
            reason = finish.reason or "length"
        else:
            reason = self._finish_alone(
                generated, len(prompt_ids), max_new_tokens, params, gen, set(eos_token_ids)
            )
        return RemoteResult(
            token_ids=generated,
            finish_reason=reason,
            server_calls=link.calls,
            bytes_up=link.up,
            bytes_down=link.down,
            cycles=cycles,
            accepted_tokens=accepted_total,
            wall_time_s=time.perf_counter() - t0,
            disconnected_at=disconnected_at,
        )

    def _draft(
        self, last: int, position: int, left: int, k: int, tree: TreeParams | None
    ) -> DraftTree:
        """This cycle's draft below `last` (at `position`), as a tree (a chain: one branch)."""
        room = min(left - 1, self.target.max_length - position - 2)
        if room < 1:
            tokens: list[int] = []
            self.proposer.propose(last, 0, GREEDY, None)
            return DraftTree(tokens, [], [])
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

    def _absorb(
        self,
        rows: list[QTensor],
        n: int,
        start: list[int] | None = None,
        accepted: list[int] | None = None,
    ) -> None:
        """The server's rows for n verified tokens into the target parts and the proposer."""
        want = expected_rows(self.kind, self.tli)
        if len(rows) != want or any(r.rows != n for r in rows):
            raise RemoteError(
                400, f"expected {want} activation tensors of {n} rows from the server"
            )
        tensors = [r.dequantize(self.target.dtype) for r in rows]
        tail = tensors[1] if self.tli else None
        self.target.append_verified(n, tail)
        out = client_output(self.kind, self.target.shape.num_layers, tensors, n)
        if start is not None:
            self.proposer.start(start, out)
        else:
            assert accepted is not None
            self.proposer.accept(accepted, out)

    def _finish_alone(
        self,
        generated: list[int],
        prompt_len: int,
        max_new_tokens: int,
        params: SamplingParams,
        gen: torch.Generator,
        eos: set[int],
    ) -> str:
        """Without the server: the drafter writes the rest of the response (in place)."""
        if generated[-1] in eos:
            return "eos"
        room = min(
            max_new_tokens - len(generated),
            self.target.max_length - prompt_len - len(generated) - 1,
        )
        if room > 0:
            proposal = self.proposer.propose(generated[-1], room, params, gen)
            for token in proposal.tokens:
                generated.append(token)
                if token in eos:
                    return "eos"
        if len(generated) >= max_new_tokens:
            return "length"
        return "context"
