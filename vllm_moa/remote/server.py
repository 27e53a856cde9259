"""`vllm-moa remote-server`: the target side of client-server speculative decoding.

asyncio over TCP, one connection per client, one session (generation) at a time per connection.
Connection handlers only parse and check messages; one worker runs the target. Each round it
takes every job that has arrived (prompts, then one verification pass batched over all clients
whose drafts are in: continuous batching) and runs them in a single compute thread, so the event
loop keeps reading other clients meanwhile. A message that breaks the protocol gets an ERROR
naming the problem and its connection is closed; other clients are not affected. Limits: at most
`max_sessions` open sessions (the KV memory bound: each holds at most the target's context),
an idle timeout after which a silent client is dropped, and the frame size cap.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from vllm_moa.remote import protocol
from vllm_moa.remote.protocol import ProtocolError
from vllm_moa.remote.verifier import Session, Verifier

logger = logging.getLogger("vllm_moa.remote")


@dataclass
class ServerLimits:
    max_sessions: int = 64
    idle_timeout_s: float = 300.0
    max_frame_bytes: int = 1 << 20  # client messages are small: a prompt or a draft tree


@dataclass
class _Job:
    session: Session
    message: protocol.Start | protocol.Draft
    done: asyncio.Future[Any] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


class RemoteServer:
    def __init__(self, verifier: Verifier, limits: ServerLimits | None = None) -> None:
        self.verifier = verifier
        self.limits = limits or ServerLimits()
        self.sessions = 0
        self._queue: asyncio.Queue[_Job] = asyncio.Queue()
        self._compute = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moa-target")
        self._server: asyncio.base_events.Server | None = None
        self._worker: asyncio.Task[None] | None = None
        self._connections: set[asyncio.Task[Any]] = set()

    async def start(self, host: str = "127.0.0.1", port: int = 8100) -> int:
        """Listen; returns the bound port (port 0 picks a free one)."""
        self._server = await asyncio.start_server(self._handle, host, port)
        self._worker = asyncio.create_task(self._work())
        return int(self._server.sockets[0].getsockname()[1])

    async def serve_forever(self, host: str = "127.0.0.1", port: int = 8100) -> None:
        bound = await self.start(host, port)
        logger.info("vllm-moa remote server listening on %s:%d", host, bound)
        assert self._server is not None
        async with self._server:
            await self._server.serve_forever()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        for task in [*self._connections, *([self._worker] if self._worker else [])]:
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)
        self._compute.shutdown(wait=True)

    # -- the target worker ---------------------------------------------------------------------

    async def _work(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            jobs = [await self._queue.get()]
            while not self._queue.empty():
                jobs.append(self._queue.get_nowait())
            jobs = [j for j in jobs if not j.done.cancelled()]
            try:
                results = await loop.run_in_executor(self._compute, self._run, jobs)
            except Exception as e:  # a bug in a pass: fail its jobs, keep serving
                logger.exception("target pass failed")
                for job in jobs:
                    if not job.done.done():
                        job.done.set_exception(e)
                continue
            for job, result in zip(jobs, results, strict=True):
                if job.done.done():
                    continue
                if isinstance(result, Exception):
                    job.done.set_exception(result)
                else:
                    job.done.set_result(result)

    def _run(self, jobs: list[_Job]) -> list[Any]:
        """In the compute thread: prompts one by one, then all drafts in one pass."""
        results: dict[int, Any] = {}
        drafts = []
        for i, job in enumerate(jobs):
            if isinstance(job.message, protocol.Start):
                try:  # a prompt that fails fails alone
                    results[i] = self.verifier.prefill(job.session, job.message.prompt)
                except Exception as e:
                    logger.exception("prefill failed")
                    results[i] = e
            else:
                drafts.append(i)
        if drafts:
            batch = [(jobs[i].session, jobs[i].message) for i in drafts]
            for i, reply in zip(drafts, self.verifier.verify(batch), strict=True):  # type: ignore[arg-type]
                results[i] = reply
        return [results[i] for i in range(len(jobs))]

    async def _submit(self, session: Session, message: protocol.Start | protocol.Draft) -> Any:
        job = _Job(session, message)
        await self._queue.put(job)
        return await job.done

    # -- connections ---------------------------------------------------------------------------

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        session: Session | None = None
        task = asyncio.current_task()
        if task is not None:
            self._connections.add(task)
        try:
            while True:
                try:
                    data = await asyncio.wait_for(
                        protocol.read_frame(reader, self.limits.max_frame_bytes),
                        self.limits.idle_timeout_s,
                    )
                except (TimeoutError, asyncio.TimeoutError):  # distinct types before 3.11
                    with contextlib.suppress(ConnectionError):
                        await self._send(
                            writer, protocol.Error(408, "idle timeout: session closed")
                        )
                    return
                message = protocol.decode(data, self.limits.max_frame_bytes)
                if isinstance(message, protocol.Start):
                    if session is not None:
                        raise ProtocolError("START while a response is open: send CLOSE first")
                    if self.sessions >= self.limits.max_sessions:
                        raise ProtocolError(
                            f"server full ({self.limits.max_sessions} sessions): retry later",
                            code=503,
                        )
                    session = self.verifier.open(message)
                    self.sessions += 1
                    reply = await self._submit(session, message)
                elif isinstance(message, protocol.Draft):
                    if session is None:
                        raise ProtocolError("DRAFT before START", code=409)
                    self.verifier.check_draft(session, message)
                    reply = await self._submit(session, message)
                elif isinstance(message, protocol.Close):
                    if session is not None:
                        session, self.sessions = None, self.sessions - 1
                    continue
                else:
                    raise ProtocolError(f"a client does not send {type(message).__name__}")
                await self._send(writer, reply)
        except ProtocolError as e:
            logger.info("protocol error from %s: %s", peer, e)
            with contextlib.suppress(ConnectionError):
                await self._send(writer, protocol.Error(e.code, str(e)))
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the client went away: its session goes with it
        except Exception as e:  # a failed target pass (logged by the worker): tell this client
            with contextlib.suppress(ConnectionError):
                await self._send(writer, protocol.Error(500, f"server error: {e}"))
        finally:
            if session is not None:
                self.sessions -= 1
            writer.close()
            self._connections.discard(task)

    async def _send(self, writer: asyncio.StreamWriter, message: protocol.Message) -> None:
        """Write a message; a client that does not read it within the idle timeout is cut off
        (it would otherwise hold its session forever)."""
        try:
            writer.write(protocol.frame(message))
            await asyncio.wait_for(writer.drain(), self.limits.idle_timeout_s)
        except (TimeoutError, asyncio.TimeoutError):
            writer.transport.abort()
            raise ConnectionError("client stopped reading") from None
        except ConnectionError:
            pass


class BackgroundServer:
    """A RemoteServer on its own event loop in a daemon thread, for tests and in-process
    benchmarks: `address` is HOST:PORT (port 0 picks a free one); `stop()` shuts it down."""

    def __init__(
        self, verifier: Verifier, limits: ServerLimits | None = None, host: str = "127.0.0.1"
    ) -> None:
        self.server = RemoteServer(verifier, limits)
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()
        port: list[int] = []

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            port.append(self.loop.run_until_complete(self.server.start(host, 0)))
            ready.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        if not ready.wait(60):
            raise RuntimeError("the background server did not start")
        self.address = f"{host}:{port[0]}"

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.close(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)
