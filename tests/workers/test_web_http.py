"""The dashboard as a hostile client on the network meets it: raw HTTP against the real CLI
server (``python -m lease_celery -A tests.support.worker_app --store URL web --port 0``)."""

from __future__ import annotations

import contextlib
import os
import select
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from lease_celery import open_store
from tests.support.policy_helpers import REPO

TOKEN = "http-test-token-0123456789"


@contextlib.contextmanager
def _served(folder: Path, *options: str) -> Iterator[tuple[int, str, int]]:
    """The real CLI server (``web --port 0 --token T *options``) on a SQLite store holding a
    dead key: (port, its first line, its pid)."""
    url = f"sqlite:///{folder}/leases.sqlite3"
    with open_store(url) as store:
        lease = store.claim("secret:key", owner="w", ttl=60)
        assert lease is not None and store.kill(lease, reason="card 4242 declined")
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    log = folder / "server.log"
    with log.open("w") as stderr:
        process = subprocess.Popen(
            [sys.executable, "-m", "lease_celery", "-A", "tests.support.worker_app",
             "--store", url, "web", "--port", "0", "--token", TOKEN, *options],
            stdout=subprocess.PIPE, stderr=stderr, text=True, env=env, cwd=folder)
    try:
        assert process.stdout is not None
        ready, _, _ = select.select([process.stdout], [], [], 20)
        line = process.stdout.readline() if ready else ""
        assert "dashboard on http://" in line, (line, log.read_text())
        yield int(line.split("/ (", 1)[0].rsplit(":", 1)[1]), line, process.pid
    finally:
        process.terminate()
        process.wait(timeout=10)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, int]]:
    """The real CLI server on a free loopback port: (host, port)."""
    with _served(tmp_path_factory.mktemp("web-http")) as (port, _, _):
        yield "127.0.0.1", port


def _ask(address: tuple[str, int], head: str, *, within: float) -> str:
    """Send ``head`` (request line and headers, no body, the connection left open) and read
    the reply until the server closes it or ``within`` seconds pass."""
    with socket.create_connection(address, timeout=within) as sock:
        sock.sendall(head.encode("latin-1"))
        reply = b""
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                break
            if not chunk:
                break
            reply += chunk
        return reply.decode("utf-8", "replace")


@pytest.mark.parametrize("length", ["-1", "-100000000"])
def test_a_negative_content_length_is_answered_400_without_reading(
        server: tuple[str, int], length: str) -> None:
    """A POST whose Content-Length is negative, its body never sent: the answer is 400 within
    2 s. The server used to read(-1), waiting for the client to close (and taking in whatever
    it sent, 100 MB before any token check)."""
    host, port = server
    reply = _ask(server, f"POST /resolve?key=x HTTP/1.1\r\nHost: {host}:{port}\r\n"
                         "Content-Type: application/x-www-form-urlencoded\r\n"
                         f"Content-Length: {length}\r\n\r\n", within=2.0)
    # waitress refuses it itself ("Content-Length is invalid"); the app does too, behind any
    # other server (tests/stores/test_web.py).
    assert reply.split(" ", 2)[1] == "400", reply[:300]


def test_a_form_without_content_length_is_answered_400(server: tuple[str, int]) -> None:
    host, port = server
    reply = _ask(server, f"POST /resolve?key=x HTTP/1.1\r\nHost: {host}:{port}\r\n"
                         "Content-Type: application/x-www-form-urlencoded\r\n\r\n", within=2.0)
    assert reply.split(" ", 2)[1] == "400", reply[:300]
    assert "Content-Length" in reply


@pytest.mark.parametrize("options", [("--protect-reads",), ("--host", "0.0.0.0")],
                         ids=["asked-for", "beyond-loopback"])
def test_protected_pages_over_http_show_nothing_without_the_token(
        tmp_path: Path, options: tuple[str, ...]) -> None:
    """``web --protect-reads``, and ``web --host 0.0.0.0`` (on by default beyond loopback):
    a page is a 401 sign-in form with nothing of the store on it."""
    with _served(tmp_path, *options) as (port, line, _):
        assert "every page and action needs the operator token" in line, line
        reply = _ask(("127.0.0.1", port), f"GET /dead HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
                                          "Connection: close\r\n\r\n", within=5.0)
        assert reply.split(" ", 2)[1] == "401", reply[:300]
        assert "secret:key" not in reply and "4242" not in reply and "sign-in" in reply


def _threads(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("Threads:"))
               .split()[1])


def test_idle_connections_hold_no_thread_and_a_request_is_still_answered(
        tmp_path: Path) -> None:
    """50 connections that send half a request and then nothing (slowloris): the server
    process keeps a bounded number of threads (wsgiref held one per connection, 101 for
    100), and a normal request is answered within 2 s."""
    with _served(tmp_path) as (port, _, pid):
        before = _threads(pid)
        idle = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(50)]
        try:
            for sock in idle:
                sock.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            time.sleep(0.5)
            started = time.monotonic()
            reply = _ask(("127.0.0.1", port), f"GET / HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
                                              "Connection: close\r\n\r\n", within=5.0)
            assert reply.split(" ", 2)[1] == "200", reply[:300]
            assert time.monotonic() - started < 2.0
            assert _threads(pid) <= before + 2, (before, _threads(pid))
        finally:
            for sock in idle:
                sock.close()
