"""The client against a server that lies, breaks frames or stops answering.

A proxy between `RemoteClient` and a real server forwards every frame and rewrites one reply per
case. The client must then raise a clear error (`RemoteError` for the server's ERROR, else a
`ConnectionError` naming what was wrong) or finish the response alone from what was verified
(docs/remote.md, "Disconnection"), within the test's timeout, and never take a bad reply's
tokens. The control: the proxy with no fault gives plain decoding's output, verified by the
server."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import pytest

from tests import test_remote
from tests.test_remote import PROMPT, RunningServer
from vllm_moa.remote import protocol
from vllm_moa.remote.client import RemoteClient, RemoteError, RemoteResult
from vllm_moa.remote.protocol import QTensor

NEW = 30  # tokens per response
AT = 3  # the faulty reply: 0 is STARTED, then VERIFIED 1, 2, ...
VOCAB = 256  # the test pair's
STALL_S = 3.0  # the client's socket timeout: a silent server is given up after it

pair, plain = test_remote.pair, test_remote.plain  # its module-scoped fixtures, built here once
pytestmark = [pytest.mark.slow, pytest.mark.timeout(60), pytest.mark.fixed_k]


@dataclass
class Reply:
    """What the proxy sends instead of a server reply: `data` (framed bytes), then it goes on
    forwarding, hangs up, or holds the connection open and silent until the test ends."""

    data: bytes
    then: str = "forward"  # forward | close | stall


# fault(reply index, the client's request, every server reply so far, framed: the last is the
# one to answer) -> a Reply, or None to forward the server's reply.
Fault = Callable[[int, protocol.Message, list[bytes]], Reply | None]


class FaultyProxy:
    """Listens on a free local port; each client connection gets its own connection to the
    server at `upstream`, and every server reply passes through `fault`."""

    def __init__(self, upstream: tuple[str, int], fault: Fault | None) -> None:
        self.upstream, self.fault = upstream, fault
        self.replies: list[bytes] = []  # the last connection's server replies, framed
        self.stop = threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = ("127.0.0.1", int(self.listener.getsockname()[1]))
        self.threads = [threading.Thread(target=self._accept, daemon=True)]
        self.threads[0].start()

    def _accept(self) -> None:
        while True:
            conn, _ = self.listener.accept()
            if self.stop.is_set():  # close()'s wake-up call
                conn.close()
                return
            thread = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            self.threads.append(thread)
            thread.start()

    def _serve(self, client: socket.socket) -> None:
        self.replies = []
        with client, socket.create_connection(self.upstream) as server:
            try:
                while True:
                    data = protocol.recv_frame(client)
                    server.sendall(len(data).to_bytes(4, "big") + data)
                    request = protocol.decode(data)
                    if isinstance(request, protocol.Close):
                        continue  # a CLOSE has no reply
                    reply = protocol.recv_frame(server)
                    self.replies.append(len(reply).to_bytes(4, "big") + reply)
                    out = (
                        self.fault(len(self.replies) - 1, request, self.replies)
                        if self.fault
                        else None
                    )
                    client.sendall(out.data if out else self.replies[-1])
                    if out and out.then == "close":
                        return
                    if out and out.then == "stall":
                        self.stop.wait()
                        return
            except (OSError, protocol.ProtocolError):
                return  # either side went away

    def close(self) -> None:
        self.stop.set()
        socket.create_connection(self.address).close()  # wakes accept()
        for thread in self.threads:
            thread.join(10)
        self.listener.close()
        # Every connection ended: the client closed its socket, whatever happened.
        assert not any(thread.is_alive() for thread in self.threads), "a connection was left open"


def at(index: int, send: Callable[[protocol.Message, list[bytes]], Reply]) -> Fault:
    """A fault on reply `index` only."""
    return lambda i, request, replies: send(request, replies) if i == index else None


def raw(index: int, send: Callable[[bytes], Reply]) -> Fault:
    """Reply `index`'s framed bytes, replaced."""
    return at(index, lambda request, replies: send(replies[-1]))


def edit(change: Callable[[protocol.Draft, protocol.Verified], protocol.Message]) -> Fault:
    """The AT-th VERIFIED decoded, changed (given the DRAFT it answers), sent encoded."""

    def send(request: protocol.Message, replies: list[bytes]) -> Reply:
        reply = protocol.decode(replies[-1][4:])
        assert isinstance(request, protocol.Draft) and isinstance(reply, protocol.Verified)
        return Reply(protocol.frame(change(request, reply)))

    return at(AT, send)


def _cut(frame: bytes, keep: int) -> bytes:
    """The frame's message cut to `keep` bytes, its length prefix saying so."""
    return keep.to_bytes(4, "big") + frame[4 : 4 + keep]


def _rows_for(v: protocol.Verified, n: int) -> list[QTensor]:
    """v's row tensors resized to n tokens (the first row repeated): counts that pass."""
    return [QTensor(r.values[:1].repeat_interleave(n, 0), r.scales[:1].repeat_interleave(n, 0))
            for r in v.rows]  # fmt: skip


def _claim(v: protocol.Verified, accepted: list[int]) -> protocol.Verified:
    return replace(v, accepted=accepted, rows=_rows_for(v, len(accepted) + 1))


def _narrow(q: QTensor) -> QTensor:
    return QTensor(q.values[..., :-1].contiguous(), q.scales)


# Replies the client must drop, finishing alone from the tokens verified before them.
DROPPED: dict[str, Fault] = {
    "truncated": raw(AT, lambda f: Reply(_cut(f, len(f) - 9))),
    "header only": raw(AT, lambda f: Reply(_cut(f, 4))),
    "trailing bytes": raw(AT, lambda f: Reply(_cut(f + b"xyz", len(f) - 1))),
    "garbage": raw(AT, lambda f: Reply(b"\0\0\0\x10garbage garbage!")),
    "a frame over the size limit": raw(AT, lambda f: Reply((1 << 30).to_bytes(4, "big"))),
    "closed mid-frame": raw(AT, lambda f: Reply(f[: len(f) // 2], then="close")),
    "closed instead of replying": raw(AT, lambda f: Reply(b"", then="close")),
    "silent mid-frame": raw(AT, lambda f: Reply(f[:10], then="stall")),
    "a length past the message": raw(
        AT, lambda f: Reply((len(f) + 96).to_bytes(4, "big") + f[4:], then="stall")
    ),
    "silent": raw(AT, lambda f: Reply(b"", then="stall")),
    "the previous reply again": at(AT, lambda request, replies: Reply(replies[-2])),
    "wrong cycle": edit(lambda d, v: replace(v, cycle=v.cycle + 1)),
    "STARTED instead": edit(lambda d, v: protocol.Started(v.next_token, v.finish, v.rows)),
    "the DRAFT echoed": edit(lambda d, v: d),
    "a row tensor missing": edit(lambda d, v: replace(v, rows=v.rows[:1])),
    "rows of another token count": edit(lambda d, v: replace(v, rows=_rows_for(v, 3))),
    "row tensors swapped": edit(lambda d, v: replace(v, rows=v.rows[::-1])),
    "rows one value narrower": edit(lambda d, v: replace(v, rows=[_narrow(r) for r in v.rows])),
    "more accepted than drafted": edit(lambda d, v: _claim(v, [*d.tokens, d.tokens[0]])),
    "accepted tokens never drafted": edit(lambda d, v: _claim(v, [(d.tokens[0] + 1) % VOCAB])),
    "next token outside the vocabulary": edit(lambda d, v: replace(v, next_token=VOCAB)),
    "accepted token outside the vocabulary": edit(lambda d, v: _claim(v, [VOCAB + 7])),
}


@pytest.fixture(scope="module")
def server(pair) -> Iterator[RunningServer]:
    running = RunningServer(pair["target"], pair["moa1"])
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(pair) -> RemoteClient:
    """MoA with TLI 1: two row tensors a reply, so that they can be swapped. Fixed K = 4."""
    return RemoteClient("127.0.0.1:1", pair["target"], pair["moa1"], timeout_s=STALL_S)


def _address(server: RunningServer) -> tuple[str, int]:
    host, port = server.address.rsplit(":", 1)
    return host, int(port)


def run(
    client: RemoteClient, server: RunningServer, fault: Fault | None
) -> tuple[RemoteResult, FaultyProxy]:
    proxy = FaultyProxy(_address(server), fault)
    client.address = proxy.address
    try:
        return client.generate(PROMPT, NEW, adaptive=False), proxy
    finally:
        proxy.close()


@pytest.fixture(scope="module")
def alone_after(client, server) -> Callable[[int], list[int]]:
    """The output of a clean response that leaves the server after d tokens: what a client that
    drops a bad reply after d verified tokens must write."""
    cache: dict[int, list[int]] = {}

    def output(d: int) -> list[int]:
        if d not in cache:
            client.address = _address(server)
            result = client.generate(PROMPT, NEW, adaptive=False, disconnect_after=d)
            assert result.disconnected_at == d
            cache[d] = result.token_ids
        return cache[d]

    return output


def test_the_proxy_is_transparent(client, server, plain):
    before = server.verifier.sessions_verified
    result, proxy = run(client, server, None)
    assert result.token_ids == plain(PROMPT, NEW) and result.disconnected_at is None
    assert server.verifier.sessions_verified - before == result.cycles > AT
    assert len(proxy.replies) == result.server_calls


@pytest.mark.parametrize("case", list(DROPPED))
def test_a_bad_reply_is_dropped_and_the_client_finishes_alone(
    client, server, plain, alone_after, case
):
    result, _ = run(client, server, DROPPED[case])
    d = result.disconnected_at
    assert d is not None, "the bad reply was taken"
    assert result.cycles == AT - 1  # replies 1 .. AT - 1 verified; the bad one never counted
    assert result.token_ids[:d] == plain(PROMPT, NEW)[:d]
    assert result.token_ids == alone_after(d)  # the bad reply's tokens are nowhere
    assert len(result.token_ids) == NEW and result.finish_reason == "length"


# Replies to the START: before STARTED's rows arrive the client has nothing to draft from, so it
# raises (docs/remote.md, "Disconnection"), naming what was wrong.
def _started(change: Callable[[protocol.Started], protocol.Message]) -> Fault:
    def send(request: protocol.Message, replies: list[bytes]) -> Reply:
        reply = protocol.decode(replies[-1][4:])
        assert isinstance(reply, protocol.Started)
        return Reply(protocol.frame(change(reply)))

    return at(0, send)


REFUSED: dict[str, tuple[Fault, type[Exception], str]] = {
    "STARTED truncated": (raw(0, lambda f: Reply(_cut(f, len(f) - 9))), ConnectionError, "gzip"),
    "STARTED silent": (raw(0, lambda f: Reply(b"", then="stall")), ConnectionError, "timed out"),
    "STARTED closed mid-frame": (
        raw(0, lambda f: Reply(f[:9], then="close")), ConnectionError, "closed the connection"
    ),
    "VERIFIED for the START": (
        _started(lambda s: protocol.Verified(0, [], s.first_token, s.finish, s.rows)),
        ConnectionError, "expected STARTED",
    ),
    "STARTED's first token outside the vocabulary": (
        _started(lambda s: replace(s, first_token=VOCAB)), ConnectionError, "outside the vocab"
    ),
    "STARTED's rows one value narrower": (
        _started(lambda s: replace(s, rows=[_narrow(r) for r in s.rows])),
        ConnectionError, "STARTED rows do not fit",
    ),
    "an ERROR at the START": (
        raw(0, lambda f: Reply(protocol.frame(protocol.Error(503, "server full")))),
        RemoteError, "server error 503: server full",
    ),
    # Not a disconnection: the server's word that it refuses, also mid-response.
    "an ERROR mid-response": (
        raw(AT, lambda f: Reply(protocol.frame(protocol.Error(409, "out of order")))),
        RemoteError, "server error 409: out of order",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_bad_reply_before_any_rows_or_an_error_raises(client, server, case):
    fault, error, message = REFUSED[case]
    with pytest.raises(error, match=message):
        run(client, server, fault)


def test_a_false_next_token_is_the_servers_word(client, server, plain):
    """What the client cannot check: the next token (the target's correction or bonus token, or
    a whole in-vocabulary reply meant for another session at the same cycle: VERIFIED carries no
    session id, as a session is its connection) is the target's word, and the client holds no
    full target to check it with. A lie there is taken at its one position and stays there: the
    server goes on from its own context, so every other token is still plain decoding's."""
    expected = plain(PROMPT, NEW)
    forged: list[int] = []

    def lie(d: protocol.Draft, v: protocol.Verified) -> protocol.Verified:
        forged.append((v.next_token + 1) % VOCAB)
        return replace(v, next_token=forged[0])

    result, _ = run(client, server, edit(lie))
    assert result.disconnected_at is None
    diff = [i for i, (a, b) in enumerate(zip(result.token_ids, expected, strict=True)) if a != b]
    assert len(diff) == 1 and result.token_ids[diff[0]] == forged[0]
