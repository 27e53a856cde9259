"""The client-server wire format, version 1 (docs/remote.md has the byte layout as a table).

Every message is one frame on a TCP stream: a 4-byte big-endian length, then the message: 2 bytes
of magic `MS`, 1 byte of protocol version, 1 byte of type, then the type's body. Integers are
big-endian; token ids take 3 bytes (vocabularies up to 16.7M tokens).

Client -> server:
- START (gzip body): max_new_tokens u32, temperature f32, top_p f32, top_k u32, seed i64 (-1 =
  none), the drafter's 8-byte fingerprint, then the prompt's token ids.
- DRAFT: cycle u32, node count u8 (<= 255), the nodes' token ids, then one byte per node: its
  parent + 1 (0 = the root, the last token the server sent; a chain is 0, 1, 2, ...).
- CLOSE: empty; the server frees the session.

Server -> client:
- STARTED (gzip body): first token, finish u8, then the prompt's activation rows.
- VERIFIED: cycle u32, finish u8, accepted count u8, the accepted tokens, the next token (the
  target's correction or bonus token), then the activation rows of the root and the accepted
  tokens.
- ERROR: code u16, then a UTF-8 message; the server closes the connection after it.

Activations are the tensors the client's drafter needs per verified token (protocol.py does not
know which: `remote/split.py` does), each quantised to int8 with one float16 scale per vector
of its last dimension (symmetric, absmax / 127): count u8, then per tensor: ndim u8, dims u32
each, scales (fp16, one per vector), values (int8).
"""

from __future__ import annotations

import asyncio
import gzip
import math
import socket
import struct
import zlib
from dataclasses import dataclass, field
from enum import IntEnum

import numpy as np
import torch

MAGIC = b"MS"
VERSION = 1
MAX_FRAME_BYTES = 256 << 20  # a frame longer than this is refused before it is read
MAX_TREE_NODES = 255
MAX_TOKEN_ID = (1 << 24) - 1
FINGERPRINT_BYTES = 8
_HEADER = struct.Struct(">2sBB")
_LENGTH = struct.Struct(">I")
_START = struct.Struct(">IffIq8s")
_CYCLE = struct.Struct(">IB")  # cycle, node count / finish
_VERIFIED = struct.Struct(">IBB")  # cycle, finish, accepted count


class ProtocolError(ValueError):
    """A message that breaks the protocol: what is wrong, in words a client author can act on."""

    def __init__(self, message: str, code: int = 400) -> None:
        super().__init__(message)
        self.code = code


class MessageType(IntEnum):
    START = 1
    DRAFT = 2
    CLOSE = 3
    STARTED = 16
    VERIFIED = 17
    ERROR = 18


class Finish(IntEnum):
    NONE = 0
    EOS = 1
    LENGTH = 2  # max_new_tokens
    CONTEXT = 3  # the target's context is full

    @property
    def reason(self) -> str | None:
        return None if self is Finish.NONE else self.name.lower()


@dataclass
class QTensor:
    """An int8 tensor with one float16 scale per vector of its last dimension."""

    values: torch.Tensor  # int8 [..., W]
    scales: torch.Tensor  # float16 [...]

    @classmethod
    def quantize(cls, x: torch.Tensor) -> QTensor:
        x = x.detach().float().cpu()
        absmax = x.abs().amax(dim=-1)
        scales = torch.where(absmax > 0, absmax / 127.0, torch.ones_like(absmax)).half()
        values = torch.round(x / scales.float()[..., None]).clamp_(-127, 127).to(torch.int8)
        return cls(values, scales)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.values.float() * self.scales.float()[..., None]).to(dtype)

    @property
    def rows(self) -> int:
        return int(self.values.shape[0])


@dataclass
class Start:
    prompt: list[int]
    max_new_tokens: int
    fingerprint: bytes
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None


@dataclass
class Draft:
    cycle: int
    tokens: list[int]
    parents: list[int]  # -1 = the root; else an earlier node's index


@dataclass
class Close:
    pass


@dataclass
class Started:
    first_token: int
    finish: Finish
    rows: list[QTensor] = field(default_factory=list)


@dataclass
class Verified:
    cycle: int
    accepted: list[int]
    next_token: int
    finish: Finish
    rows: list[QTensor] = field(default_factory=list)


@dataclass
class Error:
    code: int
    message: str


Message = Start | Draft | Close | Started | Verified | Error


# -- encoding ----------------------------------------------------------------------------------


def _tokens(ids: list[int]) -> bytes:
    out = bytearray()
    for t in ids:
        if not 0 <= t <= MAX_TOKEN_ID:
            raise ProtocolError(f"token id {t} does not fit the protocol's 3 bytes")
        out += t.to_bytes(3, "big")
    return bytes(out)


def _qtensors(tensors: list[QTensor]) -> bytes:
    if len(tensors) > 255:
        raise ProtocolError(f"{len(tensors)} activation tensors: at most 255")
    out = bytearray([len(tensors)])
    for q in tensors:
        dims = list(q.values.shape)
        out.append(len(dims))
        out += b"".join(_LENGTH.pack(d) for d in dims)
        out += q.scales.contiguous().numpy().astype(">f2").tobytes()
        out += q.values.contiguous().numpy().tobytes()
    return bytes(out)


def encode(message: Message) -> bytes:
    """The message, headed (magic, version, type), without the frame's length."""
    if isinstance(message, Start):
        seed = -1 if message.seed is None else message.seed
        if len(message.fingerprint) != FINGERPRINT_BYTES:
            raise ProtocolError(f"a drafter fingerprint has {FINGERPRINT_BYTES} bytes")
        body = _START.pack(
            message.max_new_tokens,
            message.temperature,
            message.top_p,
            message.top_k,
            seed,
            message.fingerprint,
        ) + _tokens(message.prompt)
        return _head(MessageType.START) + gzip.compress(body, mtime=0)
    if isinstance(message, Draft):
        m = len(message.tokens)
        if m > MAX_TREE_NODES or len(message.parents) != m:
            raise ProtocolError(f"a draft has at most {MAX_TREE_NODES} nodes, each with a parent")
        parents = bytes(p + 1 for p in message.parents)
        body = _CYCLE.pack(message.cycle, m) + _tokens(message.tokens) + parents
        return _head(MessageType.DRAFT) + body
    if isinstance(message, Close):
        return _head(MessageType.CLOSE)
    if isinstance(message, Started):
        body = _tokens([message.first_token]) + bytes([message.finish]) + _qtensors(message.rows)
        return _head(MessageType.STARTED) + gzip.compress(body, compresslevel=6, mtime=0)
    if isinstance(message, Verified):
        a = len(message.accepted)
        body = (
            _VERIFIED.pack(message.cycle, message.finish, a)
            + _tokens([*message.accepted, message.next_token])
            + _qtensors(message.rows)
        )
        return _head(MessageType.VERIFIED) + body
    if isinstance(message, Error):
        return _head(MessageType.ERROR) + struct.pack(">H", message.code) + message.message.encode()
    raise TypeError(f"not a protocol message: {type(message).__name__}")


def _head(kind: MessageType) -> bytes:
    return _HEADER.pack(MAGIC, VERSION, kind)


# -- decoding ----------------------------------------------------------------------------------


class _Reader:
    def __init__(self, data: bytes, what: str) -> None:
        self.data, self.at, self.what = data, 0, what

    def take(self, n: int, item: str) -> bytes:
        if n < 0 or self.at + n > len(self.data):
            raise ProtocolError(
                f"{self.what} message is truncated: {item} needs {n} bytes at offset {self.at}, "
                f"{len(self.data) - self.at} left"
            )
        out = self.data[self.at : self.at + n]
        self.at += n
        return out

    def unpack(self, fmt: struct.Struct, item: str) -> tuple:
        return fmt.unpack(self.take(fmt.size, item))

    def tokens(self, n: int, item: str) -> list[int]:
        raw = self.take(3 * n, item)
        return [int.from_bytes(raw[i : i + 3], "big") for i in range(0, len(raw), 3)]

    def qtensors(self) -> list[QTensor]:
        (count,) = self.take(1, "the tensor count")
        out = []
        for i in range(count):
            (ndim,) = self.take(1, f"tensor {i}'s rank")
            if not 1 <= ndim <= 6:
                raise ProtocolError(f"{self.what}: tensor {i} has rank {ndim}; 1..6 allowed")
            dims = [self.unpack(_LENGTH, f"tensor {i}'s dimensions")[0] for _ in range(ndim)]
            vectors = math.prod(dims[:-1])
            size = vectors * dims[-1]
            if size > len(self.data):
                raise ProtocolError(f"{self.what}: tensor {i} claims {dims}, more than was sent")
            scales = np.frombuffer(self.take(2 * vectors, f"tensor {i}'s scales"), ">f2")
            values = np.frombuffer(self.take(size, f"tensor {i}'s values"), np.int8)
            out.append(
                QTensor(
                    torch.from_numpy(values.copy()).view(dims),
                    torch.from_numpy(scales.astype(np.float16)).view(dims[:-1]),
                )
            )
        return out

    def end(self) -> None:
        if self.at != len(self.data):
            raise ProtocolError(
                f"{self.what} message has {len(self.data) - self.at} unexpected trailing bytes"
            )


def _gunzip(data: bytes, what: str, limit: int) -> bytes:
    inflater = zlib.decompressobj(wbits=31)  # gzip container
    try:
        out = inflater.decompress(data, limit)
    except zlib.error as e:
        raise ProtocolError(f"{what} message is not valid gzip: {e}") from None
    if inflater.unconsumed_tail:
        raise ProtocolError(f"{what} message inflates beyond {limit} bytes")
    if not inflater.eof:
        raise ProtocolError(f"{what} message's gzip stream is truncated")
    return out


def decode(data: bytes, max_inflated: int = MAX_FRAME_BYTES) -> Message:
    """One message (as `encode` writes it); ProtocolError says what is wrong with a bad one."""
    if len(data) < _HEADER.size:
        raise ProtocolError(f"message of {len(data)} bytes is shorter than its 4-byte header")
    magic, version, kind = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise ProtocolError(f"not a vllm-moa remote message (magic {magic!r}, expected {MAGIC!r})")
    if version != VERSION:
        raise ProtocolError(
            f"protocol version {version} is not spoken here (this side speaks {VERSION}): "
            "use matching vllm-moa releases on client and server",
            code=426,
        )
    try:
        kind = MessageType(kind)
    except ValueError:
        raise ProtocolError(f"unknown message type {kind}") from None
    body = data[_HEADER.size :]
    what = kind.name
    if kind in (MessageType.START, MessageType.STARTED):
        body = _gunzip(body, what, max_inflated)
    r = _Reader(body, what)
    message: Message
    if kind is MessageType.START:
        new, temperature, top_p, top_k, seed, fingerprint = r.unpack(_START, "the header")
        rest = len(body) - r.at
        if rest % 3:
            raise ProtocolError(f"START: {rest} bytes of prompt is not a whole number of tokens")
        message = Start(
            r.tokens(rest // 3, "the prompt"),
            new,
            fingerprint,
            temperature,
            top_p,
            top_k,
            None if seed == -1 else seed,
        )
    elif kind is MessageType.DRAFT:
        cycle, m = r.unpack(_CYCLE, "the header")
        tokens = r.tokens(m, "the draft tokens")
        parents = [p - 1 for p in r.take(m, "the tree positions")]
        for i, p in enumerate(parents):
            if not -1 <= p < i:
                raise ProtocolError(
                    f"DRAFT node {i} names parent {p}: a parent must be an earlier node or the "
                    "root (tree position 0)"
                )
        message = Draft(cycle, tokens, parents)
    elif kind is MessageType.CLOSE:
        message = Close()
    elif kind is MessageType.STARTED:
        (first,) = r.tokens(1, "the first token")
        message = Started(first, _finish(r), r.qtensors())
    elif kind is MessageType.VERIFIED:
        cycle, finish, a = r.unpack(_VERIFIED, "the header")
        tokens = r.tokens(a + 1, "the tokens")
        message = Verified(cycle, tokens[:a], tokens[a], _finish_of(finish), r.qtensors())
    else:
        (code,) = r.unpack(struct.Struct(">H"), "the code")
        message = Error(code, r.take(len(body) - r.at, "the text").decode(errors="replace"))
    r.end()
    return message


def _finish(r: _Reader) -> Finish:
    (value,) = r.take(1, "the finish code")
    return _finish_of(value)


def _finish_of(value: int) -> Finish:
    try:
        return Finish(value)
    except ValueError:
        raise ProtocolError(f"unknown finish code {value}") from None


# -- framing -----------------------------------------------------------------------------------


def frame(message: Message) -> bytes:
    data = encode(message)
    return _LENGTH.pack(len(data)) + data


def _check_length(n: int, limit: int) -> None:
    if n > limit:
        raise ProtocolError(f"frame of {n} bytes exceeds the limit of {limit}", code=413)


async def read_frame(reader: asyncio.StreamReader, limit: int = MAX_FRAME_BYTES) -> bytes:
    """One frame's message bytes; asyncio.IncompleteReadError at a clean or broken EOF."""
    (n,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
    _check_length(n, limit)
    return await reader.readexactly(n)


def recv_frame(sock: socket.socket, limit: int = MAX_FRAME_BYTES) -> bytes:
    """The blocking client's read; ConnectionError if the stream ends mid-frame."""
    (n,) = _LENGTH.unpack(_recv_exactly(sock, _LENGTH.size))
    _check_length(n, limit)
    return _recv_exactly(sock, n)


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise ConnectionError("the server closed the connection")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)
