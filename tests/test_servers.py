"""tests/servers.py: a test server whose port is taken between choosing it and binding it is
started again on another port; any other failure fails at once; readiness is the server's own.
A stand-in server (Python's http.server) plays `vllm serve`."""

from __future__ import annotations

import http.server
import socket
import sys
import threading
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from tests import servers

# Binds the port it is given (no SO_REUSEPORT: a port another socket listens on fails with
# "[Errno 98] Address already in use"), then says it started and answers /health.
STAND_IN = """
import http.server, sys

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass

server = http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health)
print("Application startup complete.", flush=True)
server.serve_forever()
"""


def stand_in(port: int) -> list[str]:
    return [sys.executable, "-c", STAND_IN, str(port)]


@contextmanager
def taken_port() -> Iterator[int]:
    """A port another socket listens on meanwhile."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield int(s.getsockname()[1])


def ports_from(monkeypatch, *first: int) -> list[int]:
    """servers.free_port hands out `first`, then really free ports; returns the ports handed."""
    handed: list[int] = []
    queue = list(first)
    real = servers.free_port

    def port() -> int:
        handed.append(queue.pop(0) if queue else real())
        return handed[-1]

    monkeypatch.setattr(servers, "free_port", port)
    return handed


def get(url: str) -> int:
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.status


def test_a_taken_port_is_retried_on_another(tmp_path, monkeypatch):
    log = tmp_path / "server.log"
    with taken_port() as port:
        handed = ports_from(monkeypatch, port)
        with servers.serving(stand_in, {}, log, wait=30, name="stand-in") as base:
            assert get(base + "/health") == 200
    assert len(handed) == 2 and base.endswith(f":{handed[1]}") and handed[1] != port
    assert "Address already in use" in (tmp_path / "server.log.attempt1").read_text()
    assert "Application startup complete." in log.read_text()


def test_a_port_taken_every_time_fails_clearly(tmp_path, monkeypatch):
    with taken_port() as port:
        ports_from(monkeypatch, port, port, port)
        with (
            pytest.raises(pytest.fail.Exception, match="port already in use 3 times"),
            servers.serving(stand_in, {}, tmp_path / "server.log", wait=30, name="stand-in"),
        ):
            pass
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        f"server.log.attempt{n}" for n in (1, 2, 3)
    ]


def test_control_another_failure_is_not_retried(tmp_path, monkeypatch):
    """Only a taken address is retried: a server failing otherwise fails at once."""
    handed = ports_from(monkeypatch)

    def failing(port: int) -> list[str]:
        return [sys.executable, "-c", "import sys; print('no model here'); sys.exit(3)"]

    with (
        pytest.raises(pytest.fail.Exception, match="exited with 3:\nno model here"),
        servers.serving(failing, {}, tmp_path / "server.log", wait=30, name="stand-in"),
    ):
        pass
    assert len(handed) == 1


def test_another_process_answering_on_the_port_is_not_taken_for_ours(tmp_path, monkeypatch):
    """/health answered by a foreign server on the port, while ours never starts: not ready."""

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    foreign = http.server.HTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=foreign.serve_forever, daemon=True).start()
    try:
        port = foreign.server_address[1]
        ports_from(monkeypatch, port)
        sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
        with (
            pytest.raises(pytest.fail.Exception, match="did not become ready in 3 s"),
            servers.serving(lambda p: sleeper, {}, tmp_path / "log", wait=3, name="stand-in"),
        ):
            pass
    finally:
        foreign.shutdown()
        foreign.server_close()
