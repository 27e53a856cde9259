"""Starting an HTTP server the tests talk to (`vllm serve`) on a free local port.

A free port is found by binding port 0 and closing the socket: another process may take it
before the server binds it. So a server that exits because its address is in use (its log
says so) is started again on a new port, up to `attempts` times; any other exit, or a server
that never becomes ready, fails at once with its log. The server counts as ready when /health
answers 200 and its own log says it started (not another process answering on that port).
"""

from __future__ import annotations

import socket
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

ADDRESS_IN_USE = ("Address already in use", "EADDRINUSE")  # Linux's strerror / errno name
STARTED = "Application startup complete."  # uvicorn, once the server listens


def free_port() -> int:
    """A port free now (not reserved: see the module's docstring)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _address_in_use(log: Path) -> bool:
    text = log.read_text(errors="replace")
    return any(sign in text for sign in ADDRESS_IN_USE)


def _healthy(base: str) -> bool:
    try:
        with urllib.request.urlopen(base + "/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextmanager
def serving(
    command: Callable[[int], list[str]],
    env: dict[str, str],
    log: Path,
    wait: float = 240,
    attempts: int = 3,
    name: str = "vllm serve",
) -> Iterator[str]:
    """Start `command(port)` with `env` (output in `log`) on a free port; yield its base URL once
    it is ready, and stop it after. An attempt whose server exited with its address in use is
    kept as `log` + `.attempt<n>` and the server is started again on another port."""
    taken: list[int] = []
    for attempt in range(1, attempts + 1):
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        with open(log, "w") as out:
            proc = subprocess.Popen(command(port), stdout=out, stderr=subprocess.STDOUT, env=env)
        deadline = time.time() + wait
        ready = False
        try:
            while time.time() < deadline:
                if proc.poll() is not None:
                    break
                if STARTED in log.read_text(errors="replace") and _healthy(base):
                    ready = True
                    break
                time.sleep(1)
        except BaseException:
            _stop(proc)
            raise
        if ready:
            try:
                yield base
            finally:
                _stop(proc)
            return
        exited = proc.poll()
        _stop(proc)
        tail = log.read_text(errors="replace")[-4000:]
        if exited is None:
            pytest.fail(f"{name} did not become ready in {wait:.0f} s:\n{tail}")
        if not _address_in_use(log):
            pytest.fail(f"{name} exited with {exited}:\n{tail}")
        taken.append(port)
        log.replace(log.with_name(f"{log.name}.attempt{attempt}"))
    pytest.fail(
        f"{name} found its port already in use {attempts} times (ports {taken}, each free when "
        f"chosen): something on this machine keeps taking them; logs: {log}.attempt<n>"
    )
