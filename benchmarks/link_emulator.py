"""A userspace network link between a client and a server: delay, jitter, bandwidth and loss.

Two ways (`open_links`): Linux traffic control, the server in a network namespace behind a veth
pair with `tc netem` on both ends (needs root, iproute2 and the kernel's `sch_netem`), or, where
netem is missing, a TCP relay in userspace. The machine these results come from has no
`sch_netem` (`tc qdisc add ... netem` answers "Specified qdisc kind is unknown", and there is no
modprobe), so its runs used the relay. The relay applies a profile per direction:
each chunk the relay reads is serialised at the link's rate, then delivered after a delay drawn
from a normal distribution (clipped at 0, in order, as TCP delivers), and each 1448-byte packet
in it is lost with the profile's probability, which costs a retransmission timeout (200 ms,
Linux's minimum RTO). Delays apply in each direction, so a round trip pays two draws.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import ClassVar

MSS = 1448
RTO_S = 0.2


@dataclass(frozen=True)
class LinkProfile:
    name: str
    delay_ms: float = 0.0  # one way
    jitter_ms: float = 0.0  # standard deviation of the one-way delay
    rate_mbit: float | None = None  # None = unlimited
    loss: float = 0.0  # per packet


PROFILES = {
    "unconstrained": LinkProfile("unconstrained"),
    # The MoA paper, section 4.2: 5G = 10 +- 10 ms normal, 0.1% loss; 4G = 20 Mbit/s,
    # 21 +- 19 ms normal, 0.1% loss.
    "5g": LinkProfile("5g", 10.0, 10.0, None, 0.001),
    "4g": LinkProfile("4g", 21.0, 19.0, 20.0, 0.001),
}


class _Direction:
    def __init__(self, profile: LinkProfile, rng: random.Random) -> None:
        self.p, self.rng = profile, rng
        self.free_at = 0.0  # when the link has sent what it holds
        self.last_delivery = 0.0

    def delivery_time(self, size: int, now: float) -> float:
        p = self.p
        serial = size * 8 / (p.rate_mbit * 1e6) if p.rate_mbit else 0.0
        self.free_at = max(now, self.free_at) + serial
        delay = max(0.0, self.rng.gauss(p.delay_ms, p.jitter_ms)) / 1000 if p.delay_ms else 0.0
        packets = -(-size // MSS)
        lost = sum(self.rng.random() < p.loss for _ in range(packets)) if p.loss else 0
        at = self.free_at + delay + lost * RTO_S
        self.last_delivery = max(self.last_delivery, at)  # in order
        return self.last_delivery


class LinkEmulator:
    """Listens on a local port and relays each connection to `upstream` through the profile."""

    def __init__(self, upstream: tuple[str, int], profile: LinkProfile, seed: int = 0) -> None:
        self.upstream, self.profile = upstream, profile
        self.rng = random.Random(seed)
        self.loop = asyncio.new_event_loop()
        self.port = 0

    async def _pump(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, way: _Direction
    ) -> None:
        queue: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue()

        async def deliver() -> None:
            while (item := await queue.get()) is not None:
                at, data = item
                wait = at - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                writer.write(data)
                await writer.drain()
            writer.close()

        sender = asyncio.create_task(deliver())
        try:
            while data := await reader.read(1 << 16):
                queue.put_nowait((way.delivery_time(len(data), time.monotonic()), data))
        except ConnectionError:
            pass
        queue.put_nowait(None)
        with contextlib.suppress(ConnectionError):
            await sender

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            writer.close()
            return
        up = _Direction(self.profile, random.Random(self.rng.random()))
        down = _Direction(self.profile, random.Random(self.rng.random()))
        await asyncio.gather(self._pump(reader, up_writer, up), self._pump(up_reader, writer, down))

    def start(self) -> int:
        ready = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            server = self.loop.run_until_complete(
                asyncio.start_server(self._handle, "127.0.0.1", 0)
            )
            self.port = server.sockets[0].getsockname()[1]
            ready.set()
            self.loop.run_forever()

        threading.Thread(target=run, daemon=True).start()
        ready.wait(10)
        return self.port

    def stop(self) -> None:
        async def shutdown() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shutdown(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)


# -- the two ways to put a link between client and server --------------------------------------


def _sh(*cmd: str, netns: str | None = None) -> subprocess.CompletedProcess[str]:
    full = ["ip", "netns", "exec", netns, *cmd] if netns else list(cmd)
    return subprocess.run(full, capture_output=True, text=True, check=False)


def netem_unavailable() -> str | None:
    """Why `tc netem` in a network namespace cannot be used here, or None if it can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (ip, tc) is not installed"
    probe = "moa-netem-probe"
    made = _sh("ip", "netns", "add", probe)
    if made.returncode:
        return f"cannot make a network namespace: {made.stderr.strip()}"
    try:
        tried = _sh("tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms", netns=probe)
        return f"tc netem: {tried.stderr.strip()}" if tried.returncode else None
    finally:
        _sh("ip", "netns", "del", probe)


class Links:
    """Where the server listens and how the client reaches it under each profile."""

    kind = ""
    server_host = "127.0.0.1"
    server_prefix: ClassVar[tuple[str, ...]] = ()  # prepended to the server's command

    def client_address(self, profile: LinkProfile, server_port: int) -> tuple[str, int]:
        raise NotImplementedError

    def close(self) -> None:
        pass


class RelayLinks(Links):
    """The userspace relay of this module, one per profile."""

    kind = "relay"

    def __init__(self) -> None:
        self.relays: list[LinkEmulator] = []

    def client_address(self, profile: LinkProfile, server_port: int) -> tuple[str, int]:
        relay = LinkEmulator(("127.0.0.1", server_port), profile, seed=len(self.relays) + 1)
        self.relays.append(relay)
        return "127.0.0.1", relay.start()

    def close(self) -> None:
        for relay in self.relays:
            relay.stop()


class NetemLinks(Links):
    """The server in a network namespace behind a veth pair, `tc netem` on both ends (each
    direction pays the profile's delay, as with the relay)."""

    kind = "netem"
    NS, CLIENT_DEV, SERVER_DEV = "moa-server", "moa-c", "moa-s"
    server_host = "10.200.0.2"
    server_prefix: ClassVar[tuple[str, ...]] = ("ip", "netns", "exec", NS)

    def __init__(self) -> None:
        ns, c, s = self.NS, self.CLIENT_DEV, self.SERVER_DEV
        _sh("ip", "netns", "del", ns)  # a leftover of an interrupted run
        steps = [
            (None, ["ip", "netns", "add", ns]),
            (None, ["ip", "link", "add", c, "type", "veth", "peer", "name", s]),
            (None, ["ip", "link", "set", s, "netns", ns]),
            (None, ["ip", "addr", "add", "10.200.0.1/30", "dev", c]),
            (None, ["ip", "link", "set", c, "up"]),
            (ns, ["ip", "addr", "add", "10.200.0.2/30", "dev", s]),
            (ns, ["ip", "link", "set", s, "up"]),
            (ns, ["ip", "link", "set", "lo", "up"]),
        ]
        for where, cmd in steps:
            done = _sh(*cmd, netns=where)
            if done.returncode:
                self.close()
                raise RuntimeError(f"{' '.join(cmd)}: {done.stderr.strip()}")

    def client_address(self, profile: LinkProfile, server_port: int) -> tuple[str, int]:
        args = ["netem"]
        if profile.delay_ms:
            args += ["delay", f"{profile.delay_ms}ms", f"{profile.jitter_ms}ms"]
            args += ["distribution", "normal"] if profile.jitter_ms else []
        if profile.loss:
            args += ["loss", f"{100 * profile.loss}%"]
        if profile.rate_mbit:
            args += ["rate", f"{profile.rate_mbit}mbit"]
        for where, dev in ((None, self.CLIENT_DEV), (self.NS, self.SERVER_DEV)):
            if args == ["netem"]:  # unconstrained: no qdisc of ours (none may be there yet)
                _sh("tc", "qdisc", "del", "dev", dev, "root", netns=where)
                continue
            done = _sh("tc", "qdisc", "replace", "dev", dev, "root", *args, netns=where)
            if done.returncode:
                raise RuntimeError(f"tc netem on {dev}: {done.stderr.strip()}")
        return self.server_host, server_port

    def close(self) -> None:
        _sh("ip", "netns", "del", self.NS)  # takes the veth pair with it


def open_links(kind: str) -> tuple[Links, str | None]:
    """`netem`, `relay`, or `auto` (netem where it works, else the relay): the links, and why
    netem was not used (None if it was)."""
    why = netem_unavailable() if kind in ("auto", "netem") else "the relay was asked for"
    if why is None:
        return NetemLinks(), None
    if kind == "netem":
        raise SystemExit(f"--link netem: {why}")
    return RelayLinks(), why
