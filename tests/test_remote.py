"""Client-server speculative decoding: the wire format, lossless remote generation for every
drafter kind (chains and trees), batching across clients, disconnection, and a server that
survives garbage."""

from __future__ import annotations

import contextlib
import random
import re
import socket
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.conftest import make_drafter, make_hf_model
from vllm_moa.checkpoint import save_drafter
from vllm_moa.decoding import SamplingParams, SpeculativeEngine
from vllm_moa.decoding.tree import TreeParams
from vllm_moa.drafters.eagle.model import EagleDrafter
from vllm_moa.drafters.eagle3.model import Eagle3Drafter
from vllm_moa.drafters.griffin.model import GriffinDrafter
from vllm_moa.drafters.independent.model import IndependentDrafter
from vllm_moa.drafters.moa.split import DeviceMoAProposer
from vllm_moa.drafters.presets import (
    TargetInfo,
    make_eagle3_config,
    make_eagle_config,
    make_griffin_config,
    make_independent_config,
)
from vllm_moa.hf_target import HFTarget
from vllm_moa.hf_target.adapter import TreeInput
from vllm_moa.model.kv_cache import KVCache
from vllm_moa.remote import protocol
from vllm_moa.remote.client import RemoteClient, RemoteError
from vllm_moa.remote.protocol import Finish, ProtocolError, QTensor
from vllm_moa.remote.server import BackgroundServer, ServerLimits
from vllm_moa.remote.split import ServerHalf, fingerprint
from vllm_moa.remote.verifier import Verifier

# The speculative machinery at a known K, drafting every cycle (test_adaptive.py: the rule).
pytestmark = pytest.mark.fixed_k

# -- the wire format ---------------------------------------------------------------------------


def _messages() -> list[protocol.Message]:
    q = QTensor.quantize(torch.randn(3, 4, 8))
    return [
        protocol.Start([1, 2, 70000, 16_000_000], 32, b"abcdefgh", 0.7, 0.9, 5, 1234),
        protocol.Start([5], 1, b"\0" * 8),
        protocol.Draft(7, [10, 11, 12, 13], [-1, 0, 0, 2]),
        protocol.Draft(0, [], []),
        protocol.Close(),
        protocol.Started(42, Finish.NONE, [q, QTensor.quantize(torch.randn(3, 2))]),
        protocol.Verified(3, [4, 5], 6, Finish.EOS, [q]),
        protocol.Verified(4, [], 9, Finish.NONE, []),
        protocol.Error(409, "out of order ✓"),
    ]


def _same(a: object, b: object) -> bool:
    if isinstance(a, QTensor) and isinstance(b, QTensor):
        return torch.equal(a.values, b.values) and torch.equal(a.scales, b.scales)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if hasattr(a, "__dataclass_fields__"):
        return type(a) is type(b) and all(
            _same(getattr(a, f), getattr(b, f)) for f in a.__dataclass_fields__
        )
    if isinstance(a, float):
        return abs(a - b) < 1e-6  # type: ignore[operator]
    return a == b


def test_every_message_round_trips():
    for message in _messages():
        assert _same(protocol.decode(protocol.encode(message)), message), message


def test_message_sizes_follow_the_paper():
    # Client: 4 bytes per draft node; server: 3 per token plus the int8 rows (+ fp16 scales).
    draft = protocol.encode(protocol.Draft(0, list(range(10)), list(range(-1, 9))))
    assert len(draft) == 4 + 5 + 4 * 10  # header, cycle + count, nodes
    rows = QTensor.quantize(torch.randn(3, 2, 64))  # 3 tokens of 2 vectors of 64
    verified = protocol.encode(protocol.Verified(0, [1, 2], 3, Finish.NONE, [rows]))
    assert len(verified) == 4 + 6 + 3 * 3 + 1 + (1 + 3 * 4) + 3 * 2 * (2 + 64)


def test_int8_rows_are_within_half_a_step():
    x = torch.randn(50, 4, 64) * torch.logspace(-3, 3, 50)[:, None, None]
    q = QTensor.quantize(x)
    step = x.abs().amax(-1, keepdim=True) / 127
    assert ((q.dequantize() - x).abs() <= step / 2 + 1e-3 * step).all()
    assert torch.equal(QTensor.quantize(torch.zeros(2, 3)).dequantize(), torch.zeros(2, 3))


@pytest.mark.parametrize(
    "data, complaint",
    [
        (b"", "shorter than its 4-byte header"),
        (b"XX\x01\x02", "not a vllm-moa remote message"),
        (b"MS\x02\x02", "protocol version 2 is not spoken here"),
        (b"MS\x01\x63", "unknown message type 99"),
        (b"MS\x01\x02\x00\x00\x00\x01\x02\x00\x00\x05", "truncated"),
        (b"MS\x01\x01not gzip at all", "not valid gzip"),
        (b"MS\x01\x02\x00\x00\x00\x01\x01\x00\x00\x05\x05", "parent 4"),
        (b"MS\x01\x03\x00", "1 unexpected trailing bytes"),
    ],
)
def test_bad_messages_are_named(data, complaint):
    with pytest.raises(ProtocolError, match=complaint):
        protocol.decode(data)


def test_gzip_bombs_are_refused():
    import gzip

    bomb = b"MS\x01\x01" + gzip.compress(b"\0" * (4 << 20))
    with pytest.raises(ProtocolError, match="inflates beyond"):
        protocol.decode(bomb, max_inflated=1 << 20)


def test_random_and_damaged_messages_only_raise_protocol_errors():
    rng = random.Random(0)
    valid = [protocol.encode(m) for m in _messages()]
    for trial in range(3000):
        base = bytearray(rng.choice(valid))
        how = trial % 3
        if how == 0:  # truncated
            data = bytes(base[: rng.randrange(len(base) + 1)])
        elif how == 1:  # bytes flipped (the header kept half the time, to reach the bodies)
            for _ in range(rng.randint(1, 4)):
                i = rng.randrange(4 if rng.random() < 0.5 else 0, len(base)) if len(base) > 4 else 0
                base[i] = rng.randrange(256)
            data = bytes(base)
        else:  # random bytes after a valid header
            data = bytes(base[:4]) + rng.randbytes(rng.randrange(64))
        with contextlib.suppress(ProtocolError):
            protocol.decode(data)


# -- models on disk ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> dict[str, Path]:
    """A tiny Llama target on disk with a drafter of every kind for it."""
    base = tmp_path_factory.mktemp("remote_pair")
    model = make_hf_model("llama", num_layers=3, max_positions=256, seed=3, logit_scale=4.0)
    model.save_pretrained(base / "target")
    target = HFTarget(model)
    info = TargetInfo(target.shape, target.config.num_attention_heads)
    paths = {"target": base / "target"}
    for tli in (0, 1):
        paths[f"moa{tli}"] = save_drafter(
            make_drafter(target, tli=tli, seed=tli), base / f"moa{tli}"
        )
    eagle = EagleDrafter(make_eagle_config(info, preset="small"))
    eagle.init_weights(5)
    paths["eagle"] = save_drafter(eagle, base / "eagle")
    griffin = GriffinDrafter(make_griffin_config(info, preset="small"))
    griffin.init_weights(7)
    paths["griffin"] = save_drafter(griffin, base / "griffin")
    eagle3 = Eagle3Drafter(make_eagle3_config(info, preset="small"))
    eagle3.init_weights(8)
    paths["eagle3"] = save_drafter(eagle3, base / "eagle3")
    independent = IndependentDrafter(make_independent_config(info, preset="small"))
    independent.init_weights(6)
    paths["independent"] = save_drafter(independent, base / "independent")
    return paths


class RunningServer(BackgroundServer):
    """The server for a target and drafter on disk, in a background thread."""

    def __init__(self, target_dir: Path, drafter_dir: Path, limits: ServerLimits | None = None):
        from vllm_moa.checkpoint import load_drafter

        target = HFTarget.from_pretrained(target_dir)
        drafter = load_drafter(drafter_dir, target=target.shape)
        half = ServerHalf(drafter, target.shape.num_layers)
        self.verifier = Verifier(target, half, fingerprint(drafter_dir), eos_token_ids=[])
        super().__init__(self.verifier, limits)


@pytest.fixture(scope="module")
def plain(pair):
    engine = SpeculativeEngine(HFTarget.from_pretrained(pair["target"]))
    return lambda prompt, n: engine.generate(prompt, n).token_ids


class OracleDeviceProposer(DeviceMoAProposer):
    """The client's MoA proposer with a bonus on the target's greedy token (from a full local
    copy of the target, a test-only crutch) at most positions, so that drafts are accepted and
    every path of the remote cycle (multi-token accepts, TLI rows, trees) runs."""

    reference: torch.nn.Module

    @torch.no_grad()
    def draft_logits(self, position: int) -> torch.Tensor:
        logits = super().draft_logits(position)
        if position % 5 == 0:
            return logits
        best = self.reference(torch.tensor([self.tokens[: position + 1]])).logits[0, -1].argmax()
        logits = logits.clone()
        logits[best] += 50.0
        return logits


def _oracle(client: RemoteClient, target_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    proposer = client.proposer
    assert isinstance(proposer, DeviceMoAProposer)
    proposer.__class__ = OracleDeviceProposer
    proposer.reference = AutoModelForCausalLM.from_pretrained(target_dir).eval()  # type: ignore[attr-defined]


PROMPT = [3, 17, 100, 5, 9, 200, 41, 7, 7, 12]


@pytest.mark.parametrize(
    "kind, tree",
    [
        ("moa0", None),
        ("moa0", TreeParams(4, 3, 10)),
        ("moa1", None),
        ("moa1", TreeParams(3, 2, 6)),
        ("eagle", TreeParams(3, 2, 6)),
        ("griffin", None),
        ("eagle3", None),
        ("eagle3", TreeParams(3, 2, 6)),
        ("independent", None),
    ],
)
def test_remote_greedy_output_equals_plain_decoding(pair, plain, kind, tree):
    server = RunningServer(pair["target"], pair[kind])
    try:
        client = RemoteClient(server.address, pair["target"], pair[kind])
        if kind.startswith("moa"):
            _oracle(client, pair["target"])
        result = client.generate(PROMPT, 40, tree=tree, num_speculative_tokens=4)
        assert result.token_ids == plain(PROMPT, 40)
        assert result.finish_reason == "length" and result.disconnected_at is None
        assert result.server_calls == result.cycles + 1
        if kind.startswith("moa"):  # the oracle's drafts land: multi-token accepts happened
            assert result.mean_accepted_length > 1.5, result
        # Client messages: 4 bytes a node; the server's carry the rows (all but independent's).
        assert result.bytes_up < 30 + 60 * result.server_calls
        if kind == "independent":
            assert result.bytes_down < 40 * result.server_calls + 200
    finally:
        server.stop()


def test_clients_are_verified_together_and_the_server_survives_garbage(pair, plain):
    server = RunningServer(pair["target"], pair["moa1"])
    prompts = [PROMPT, PROMPT[3:], [9, 9, 8, 1, 50, 60], PROMPT[::-1]]
    results: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def client_run(i: int) -> None:
        try:
            client = RemoteClient(server.address, pair["target"], pair["moa1"])
            results[i] = client.generate(prompts[i], 30).token_ids
        except BaseException as e:  # reported below
            errors.append(e)

    def vandal(seed: int) -> None:
        """Garbage, truncated and out-of-order frames on connections of its own."""
        rng = random.Random(seed)
        host, port = server.address.split(":")
        for trial in range(12):
            with socket.create_connection((host, int(port)), timeout=10) as s:
                kind = trial % 4
                if kind == 0:
                    s.sendall(rng.randbytes(rng.randrange(1, 200)))
                elif kind == 1:  # a frame promising more than is sent, then hang up
                    s.sendall(struct.pack(">I", 1000) + b"MS\x01\x02\x00")
                elif kind == 2:
                    s.sendall(protocol.frame(protocol.Draft(3, [1], [-1])))  # before START
                else:  # a frame over the size limit
                    s.sendall(struct.pack(">I", 1 << 30))
                s.shutdown(socket.SHUT_WR)  # the server sees the end of the stream
                s.settimeout(10)
                with contextlib.suppress(OSError):
                    s.recv(1 << 16)

    # Each verification pass made slower (20 ms more), so that the clients' drafts queue up
    # while one runs and a pass verifies several: the batching asserted below, which the
    # threads' timing alone did not always produce.
    verify = server.verifier.verify

    def slow_verify(*args, **kwargs):  # type: ignore[no-untyped-def]
        time.sleep(0.02)
        return verify(*args, **kwargs)

    server.verifier.verify = slow_verify  # type: ignore[method-assign]
    try:
        threads = [threading.Thread(target=client_run, args=(i,)) for i in range(4)]
        threads += [threading.Thread(target=vandal, args=(s,)) for s in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert not errors, errors
        for i, prompt in enumerate(prompts):
            assert results[i] == plain(prompt, 30), i
        v = server.verifier
        assert v.sessions_verified > v.passes  # some passes verified several clients at once
        assert server.server.sessions == 0  # every session was freed
    finally:
        server.stop()


def test_forward_trees_equals_one_sequence_at_a_time():
    target = HFTarget(make_hf_model("mistral", num_layers=2, seed=1))  # sliding window 7
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 256, (n,), generator=gen) for n in (9, 3, 14)]
    trees = [  # (root + nodes, positions offsets, allowed) per sequence
        ([5, 6, 7], [0, 1, 1], torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)),
        ([8], [0], torch.ones(1, 1, dtype=torch.bool)),
        ([1, 2, 3, 4], [0, 1, 2, 3], torch.ones(4, 4, dtype=torch.bool).tril()),
    ]
    singles, caches = [], []
    for seq, (ids, offsets, allowed) in zip(seqs, trees, strict=True):
        target.cache = KVCache(2)
        target.forward(seq)
        caches.append(target.cache)
        target.cache = KVCache(2)
        target.forward(seq)
        pos = torch.tensor(offsets) + len(seq)
        singles.append(target.forward_tree(torch.tensor(ids), pos, allowed))
    batch = [
        TreeInput(cache, torch.tensor(ids), torch.tensor(offsets) + len(seq), allowed)
        for cache, seq, (ids, offsets, allowed) in zip(caches, seqs, trees, strict=True)
    ]
    for one, many in zip(singles, target.forward_trees(batch), strict=True):
        torch.testing.assert_close(many.logits, one.logits, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(many.layer_kv, one.layer_kv, atol=1e-5, rtol=1e-5)
    assert [c.length(0) for c in caches] == [12, 4, 18]


@contextlib.contextmanager
def link_dies_at_reply(n: int, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The client's n-th read of a reply fails as if the connection was reset (only that one:
    a reconnection finds the server again)."""
    real = protocol.recv_frame
    calls = 0

    def dying(sock: socket.socket, limit: int = protocol.MAX_FRAME_BYTES) -> bytes:
        nonlocal calls
        calls += 1
        if calls == n:
            raise ConnectionResetError("link lost")
        return real(sock, limit)

    with monkeypatch.context() as m:
        m.setattr(protocol, "recv_frame", dying)
        yield


def test_a_disconnected_client_finishes_the_response_on_the_device(pair, plain, monkeypatch):
    server = RunningServer(pair["target"], pair["moa1"])
    try:
        client = RemoteClient(server.address, pair["target"], pair["moa1"])
        _oracle(client, pair["target"])
        result = client.generate(PROMPT, 40, disconnect_after=12)
        assert result.disconnected_at is not None and result.disconnected_at >= 12
        assert len(result.token_ids) == 40 and result.finish_reason == "length"
        verified = result.disconnected_at
        assert result.token_ids[:verified] == plain(PROMPT, 40)[:verified]
        # A link that dies mid-response: the server goes away between two cycles.
        client = RemoteClient(server.address, pair["target"], pair["moa1"])
        with link_dies_at_reply(4, monkeypatch):
            result = client.generate(PROMPT, 40)
        assert result.disconnected_at is not None and len(result.token_ids) == 40
        assert result.server_calls == 4
    finally:
        server.stop()


def test_refusals_are_clear(pair, tmp_path):
    server = RunningServer(pair["target"], pair["moa0"], ServerLimits(max_sessions=1))
    try:
        other = RemoteClient(server.address, pair["target"], pair["moa1"])
        with pytest.raises(RemoteError, match="is not the server's"):
            other.generate(PROMPT, 5)
        client = RemoteClient(server.address, pair["target"], pair["moa0"])
        with pytest.raises(RemoteError, match="outside the vocabulary"):
            client.generate([1, 2, 999], 5)
        with pytest.raises(RemoteError, match="context is 256"):
            client.generate([1] * 300, 5)
        assert client.generate(PROMPT, 3).finish_reason == "length"  # still serving
    finally:
        server.stop()
    with pytest.raises(ConnectionError, match="cannot reach the server"):
        client.generate(PROMPT, 3)


def _accept_first_children(tree, target_probs, generator):
    """A broken verifier: takes the first child at every node, whatever the target says."""
    from vllm_moa.decoding.tree import TreeVerdict

    node, path = -1, []
    while tree.children(node):
        node = tree.children(node)[0]
        path.append(node)
    token = int(torch.multinomial(target_probs[node + 1], 1, generator=generator))
    return TreeVerdict(path, token)


@pytest.mark.slow
@pytest.mark.parametrize("broken", [False, True])
def test_remote_sampling_preserves_the_target_distribution(monkeypatch, broken):
    """The server's sampled verification (drafts as point masses, two sessions per pass) gives
    tokens 2..4 the target's joint law (chi-square against enumeration); a server that accepts
    the first draft at every node fails the same test."""
    from tests.test_sampling import NEW, VOCAB, _chi2_pvalue, _exact_joint
    from tests.test_sampling import PROMPT as SMALL_PROMPT
    from vllm_moa.remote import verifier as verifier_module

    if broken:
        monkeypatch.setattr(verifier_module, "verify_tree_sampling", _accept_first_children)
    model = make_hf_model(
        vocab_size=VOCAB, hidden_size=64, num_heads=1, num_layers=2, seed=6, logit_scale=8.0
    )
    target = HFTarget(model)
    info = TargetInfo(target.shape, target.config.num_attention_heads)
    independent = IndependentDrafter(make_independent_config(info, preset="small"))
    v = Verifier(target, ServerHalf(independent, 2), b"\0" * 8, eos_token_ids=[])
    params = SamplingParams(temperature=0.9)
    marginal = _exact_joint(target, params).sum(0).flatten()
    counts = torch.zeros(VOCAB ** (NEW - 1))
    tree = ([0, 1, 2, 3], [-1, -1, 0, 2])  # two roots' children, one of them two deep
    accepted = 0
    for pair_seed in range(1000):
        sessions = []
        for seed in (2 * pair_seed, 2 * pair_seed + 1):
            start = protocol.Start(SMALL_PROMPT, NEW, b"\0" * 8, 0.9, seed=seed)
            session = v.open(start)
            v.prefill(session, SMALL_PROMPT)
            sessions.append(session)
        while any(s.finish is Finish.NONE for s in sessions):
            live = [s for s in sessions if s.finish is Finish.NONE]
            replies = v.verify([(s, protocol.Draft(s.cycle, *tree)) for s in live])
            accepted += sum(len(r.accepted) for r in replies)
        for s in sessions:
            a, b, c = s.generated[1:]
            counts[(a * VOCAB + b) * VOCAB + c] += 1
    assert accepted > 500  # drafts were accepted, and (the test's point) rejected
    pvalue = _chi2_pvalue(counts, marginal)
    assert (pvalue > 1e-3) == (not broken), pvalue


@pytest.mark.slow
def test_the_cli_serves_and_generates(pair, tiny_target_dir, tmp_path):
    import json
    import subprocess
    import sys

    drafter = save_drafter(
        make_drafter(HFTarget.from_pretrained(tiny_target_dir), tli=1, seed=2), tmp_path / "d"
    )
    cli = [sys.executable, "-m", "vllm_moa.cli.main"]
    ask = ["--prompt", "def add(a, b):", "--max-new-tokens", "12", "--json"]
    common = ["--target", tiny_target_dir, "--drafter", str(drafter)]
    # Port 0: the server binds a free port itself and logs it (no port found by a test's
    # bind-then-close, which another process can take in between).
    server = subprocess.Popen(
        [*cli, "remote-server", *common, "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        port = None
        assert server.stdout is not None
        for line in server.stdout:  # until it listens (or exits: the loop ends, port is None)
            found = re.search(r"listening on 127\.0\.0\.1:(\d+)", line)
            if found:
                port = int(found.group(1))
                break
        assert port, "the server did not report a port"
        run = subprocess.run(
            [
                *cli,
                "remote-generate",
                "--server",
                f"127.0.0.1:{port}",
                *common,
                *ask,
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert run.returncode == 0, run.stderr
        record = json.loads(run.stdout)
        for key in ("text", "token_ids", "server_calls", "bytes_up", "bytes_down"):
            assert key in record
        assert record["finish_reason"] in ("length", "eos") and record["disconnected_at"] is None
        local = subprocess.run(
            [*cli, "generate", "--target", tiny_target_dir, *ask],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert json.loads(local.stdout)["token_ids"] == record["token_ids"]
    finally:
        server.terminate()
        server.wait(30)


@pytest.mark.parametrize("kind", ["moa0", "moa1", "eagle", "griffin", "eagle3", "independent"])
def test_forcing_a_drafters_own_choices_changes_nothing(pair, kind):
    """`propose(..., forced=F)`: with F the drafter's own first choices, the same drafts; with
    other tokens, they are taken as given; the proposer's state is untouched either way."""
    from vllm_moa.checkpoint import load_drafter
    from vllm_moa.factories.proposers import make_proposer

    target = HFTarget.from_pretrained(pair["target"])
    proposer = make_proposer(load_drafter(pair[kind], target=target.shape), target)
    out = target.forward(torch.tensor(PROMPT), proposer.hidden_layers)
    proposer.start(PROMPT, out)
    greedy = SamplingParams()
    free = proposer.propose(9, 8, greedy, None).tokens
    proposer.withdraw()
    assert proposer.propose(9, 8, greedy, None, forced=free[:5]).tokens == free
    proposer.withdraw()
    other = [(t + 1) % 256 for t in free[:3]]
    assert proposer.propose(9, 8, greedy, None, forced=other).tokens[:3] == other
    proposer.withdraw()
    assert proposer.propose(9, 8, greedy, None).tokens == free


def test_a_client_that_gets_its_server_back_resumes_verification(pair, plain, monkeypatch):
    """The link dies mid-response; the client writes alone in chunks and reconnects; the
    server verifies what it wrote (one draft) and decoding goes on: the output is plain
    decoding's, token for token."""
    server = RunningServer(pair["target"], pair["moa1"])
    try:
        client = RemoteClient(server.address, pair["target"], pair["moa1"])
        _oracle(client, pair["target"])
        with link_dies_at_reply(4, monkeypatch):
            result = client.generate(PROMPT, 40, reconnect_every=5)
        assert result.disconnected_at is not None and result.reconnections == 1
        assert result.token_ids == plain(PROMPT, 40)
    finally:
        server.stop()


def test_a_private_suffix_never_reaches_the_server(pair):
    server = RunningServer(pair["target"], pair["moa0"])
    seen: list[list[int]] = []
    real_open = server.verifier.open

    def spy(start: protocol.Start) -> object:
        seen.append(list(start.prompt))
        return real_open(start)

    server.verifier.open = spy  # type: ignore[method-assign,assignment]
    try:
        client = RemoteClient(server.address, pair["target"], pair["moa0"])
        secret = [201, 202, 203, 204]
        result = client.generate(PROMPT, 20, private_suffix=secret)
        assert seen == [PROMPT]  # the server saw the safe prefix only
        assert len(result.token_ids) == 20 and result.disconnected_at == 0
        assert result.server_calls == 1
        others = [client.generate(PROMPT, 20, private_suffix=[s, 7, s]).token_ids for s in (9, 99)]
        assert len({tuple(result.token_ids), *map(tuple, others)}) > 1  # the suffix is read
        assert len(seen) == 3 and all(p == PROMPT for p in seen)
    finally:
        server.stop()


def test_one_sessions_failure_leaves_the_others_replies(pair, monkeypatch):
    """A verification that raises (here: sampling, patched to fail) costs only its own session:
    the greedy session verified in the same pass gets its reply."""
    from vllm_moa.checkpoint import load_drafter
    from vllm_moa.remote import verifier as verifier_module

    target = HFTarget.from_pretrained(pair["target"])
    drafter = load_drafter(pair["moa0"], target=target.shape)
    v = Verifier(target, ServerHalf(drafter, 3), b"\0" * 8, eos_token_ids=[])
    greedy = v.open(protocol.Start(PROMPT, 8, b"\0" * 8))
    sampled = v.open(protocol.Start(PROMPT[2:], 8, b"\0" * 8, temperature=0.8, seed=1))
    for s, p in ((greedy, PROMPT), (sampled, PROMPT[2:])):
        v.prefill(s, p)

    def broken(*args: object) -> None:
        raise RuntimeError("sampling failed")

    monkeypatch.setattr(verifier_module, "verify_tree_sampling", broken)
    ok, failed = v.verify([(s, protocol.Draft(0, [1, 2], [-1, 0])) for s in (greedy, sampled)])
    assert isinstance(ok, protocol.Verified) and ok.rows and greedy.cycle == 1
    assert isinstance(failed, RuntimeError)
    with pytest.raises(ProtocolError, match="temperature 1e-09 is below"):
        v.open(protocol.Start(PROMPT, 8, b"\0" * 8, temperature=1e-9))


def test_a_client_alone_stops_at_the_context_while_the_server_stays_away(pair, monkeypatch):
    from vllm_moa.remote import client as client_module

    server = RunningServer(pair["target"], pair["moa0"])
    try:
        client = RemoteClient(server.address, pair["target"], pair["moa0"])
        real_link = client_module._Link
        links = 0

        def once(*args: object, **kwargs: object) -> object:
            nonlocal links
            links += 1
            if links > 1:
                raise ConnectionRefusedError("server down")
            return real_link(*args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(client_module, "_Link", once)
        with link_dies_at_reply(3, monkeypatch):
            result = client.generate(PROMPT, 400, reconnect_every=50)
        assert result.finish_reason == "context" and result.reconnections == 0
        assert len(PROMPT) + len(result.token_ids) == 255  # the device writes up to max - 1
        assert links > 2  # it kept trying between chunks
    finally:
        server.stop()


def test_remote_greedy_on_a_rope_scaled_target(tmp_path):
    """Client-server on a Llama-3.1-style target (llama3 RoPE scaling, positions past the
    original 16): the device's drafter records the target's scaling and applies it in its SA,
    and the remote output equals plain decoding (TLI 0 and 1, the oracle's drafts landing)."""
    from tests.test_rope_scaling import LLAMA3, THETA
    from tests.test_rope_scaling import make_drafter as scaled_drafter

    model = make_hf_model(
        "llama", num_layers=3, max_positions=256, seed=3, logit_scale=4.0,
        rope_parameters={"rope_theta": THETA, **LLAMA3},
    )  # fmt: skip
    model.save_pretrained(tmp_path / "target")
    target = HFTarget(model)
    engine = SpeculativeEngine(HFTarget.from_pretrained(tmp_path / "target"))
    expected = engine.generate(PROMPT, 40).token_ids
    for tli in (0, 1):
        drafter_dir = save_drafter(scaled_drafter(target, tli=tli, seed=tli), tmp_path / f"d{tli}")
        server = RunningServer(tmp_path / "target", drafter_dir)
        try:
            client = RemoteClient(server.address, tmp_path / "target", drafter_dir)
            proposer = client.proposer
            assert isinstance(proposer, DeviceMoAProposer)
            assert proposer.drafter.config.sa_rope_scaling == LLAMA3
            _oracle(client, tmp_path / "target")
            result = client.generate(PROMPT, 40, num_speculative_tokens=4)
            assert result.token_ids == expected, f"TLI={tli}"
            assert result.mean_accepted_length > 1.5, result
        finally:
            server.stop()


def test_adaptive_chains_stop_for_a_useless_drafter_and_stay_lossless(pair, plain, monkeypatch):
    """The client's default mode (adaptive chain lengths, the rule of the engine and the vLLM
    plugin): greedy output equals plain decoding either way; the test pair's random MoA drafter
    lands almost nothing, so after a few cycles the client drafts far fewer tokens than at a
    fixed K (the control: `adaptive=False` drafts K a cycle); the oracle drafter, whose drafts
    land, keeps drafting."""
    monkeypatch.setenv("VLLM_MOA_ADAPTIVE", "1")
    server = RunningServer(pair["target"], pair["moa0"])
    try:
        client = RemoteClient(server.address, pair["target"], pair["moa0"])
        fixed = client.generate(PROMPT, 60, num_speculative_tokens=4, adaptive=False)
        assert fixed.drafted_tokens >= 4 * (fixed.cycles - 4)  # K a cycle, less at the end
        for _ in range(2):  # the rule is kept across calls, as a served engine keeps it
            adaptive = client.generate(PROMPT, 60, num_speculative_tokens=4)
            assert adaptive.token_ids == fixed.token_ids == plain(PROMPT, 60)
        assert adaptive.drafted_tokens < 0.3 * fixed.drafted_tokens, (adaptive, fixed)
        # The oracle's drafts run a full copy of the target (a test crutch), so measured costs
        # would rightly stop it: its costs are injected (a draft step 1/20 of a round trip).
        import vllm_moa.remote.client as client_module
        from tests.costs import fixed_costs
        from vllm_moa.adaptive import DraftGuard

        monkeypatch.setattr(client_module, "StepCosts", fixed_costs(0.001))
        monkeypatch.setattr(client_module, "DraftGuard", lambda: DraftGuard(enabled=False))
        oracle = RemoteClient(server.address, pair["target"], pair["moa0"])
        _oracle(oracle, pair["target"])
        landed = oracle.generate(PROMPT, 60, num_speculative_tokens=4)
        assert landed.token_ids == fixed.token_ids
        assert landed.drafted_tokens > 2 * landed.cycles and landed.mean_accepted_length > 1.5
    finally:
        server.stop()
