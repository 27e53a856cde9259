"""A userspace network link between a client and a server: delay, jitter, bandwidth and loss.

The issue asks for Linux traffic control (`tc netem`) in network namespaces. This machine's
kernel has no `sch_netem` (`tc qdisc add ... netem` answers "Specified qdisc kind is unknown",
and there is no modprobe), so the profiles are applied by a TCP relay instead, per direction:
each chunk the relay reads is serialised at the link's rate, then delivered after a delay drawn
from a normal distribution (clipped at 0, in order, as TCP delivers), and each 1448-byte packet
in it is lost with the profile's probability, which costs a retransmission timeout (200 ms,
Linux's minimum RTO). Delays apply in each direction, so a round trip pays two draws.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
import time
from dataclasses import dataclass

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
