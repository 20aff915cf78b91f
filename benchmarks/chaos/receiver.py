"""The outside service: an HTTP server in a process of its own that records EVERY request.

It never deduplicates: one POST, one row (idempotency key, payload, token, pid, owner), kept in
a SQLite file of its own, so duplicate effects are counted where they land, not where they are
sent from. ``python -m benchmarks.chaos.receiver --db FILE --parent-pid PID`` prints
``listening on http://127.0.0.1:PORT`` first; it exits when PID is gone (the harness died), on
SIGTERM, or on ``POST /shutdown``.

``POST /send`` takes ``{"idempotency_key", "payload", "token", "pid", "owner", "task_id"}``
and answers ``{"id": <row id>}``; ``GET /requests`` lists every row, oldest first.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

__all__ = ["fetch_requests", "main", "running_receiver", "send"]

_SCHEMA = """CREATE TABLE IF NOT EXISTS received (
    id INTEGER PRIMARY KEY, t REAL NOT NULL, idempotency_key TEXT NOT NULL,
    payload TEXT NOT NULL, token INTEGER, pid INTEGER, owner TEXT, task_id TEXT)"""
_COLUMNS = ("id", "t", "idempotency_key", "payload", "token", "pid", "owner", "task_id")


class _Records:
    def __init__(self, path: str) -> None:
        self._conn = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute(_SCHEMA)
        self._lock = threading.Lock()

    def add(self, body: dict[str, Any]) -> int:
        with self._lock:
            cursor = self._conn.execute(
                "INSERT INTO received (t, idempotency_key, payload, token, pid, owner, task_id) "
                "VALUES (?, ?, ?, ?, ?, ?, ?)",
                (time.time(), str(body["idempotency_key"]),
                 json.dumps(body.get("payload"), sort_keys=True), body.get("token"),
                 body.get("pid"), body.get("owner"), body.get("task_id")))
            return int(cursor.lastrowid or 0)

    def all(self) -> list[dict[str, Any]]:
        with self._lock:
            rows = self._conn.execute(
                f"SELECT {', '.join(_COLUMNS)} FROM received ORDER BY id").fetchall()
        return [dict(zip(_COLUMNS, row, strict=True)) for row in rows]


def _handler(records: _Records, stop: threading.Event) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # (http.server's naming)
            if self.path == "/shutdown":
                self._reply(200, {"ok": True})
                stop.set()
                return
            if self.path != "/send":
                self._reply(404, {"error": "not found"})
                return
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))))
                row = records.add(body)
            except (ValueError, KeyError, TypeError) as exc:
                self._reply(400, {"error": f"bad request: {exc!r}"})
                return
            self._reply(200, {"id": row})

        def do_GET(self) -> None:
            if self.path == "/requests":
                self._reply(200, records.all())
            elif self.path == "/health":
                self._reply(200, {"ok": True})
            else:
                self._reply(404, {"error": "not found"})

        def _reply(self, status: int, payload: Any) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:
            pass  # the SQLite file is the log

    return Handler


def _watch_parent(parent: int, stop: threading.Event) -> None:
    while not stop.wait(1.0):
        try:
            os.kill(parent, 0)
        except ProcessLookupError:
            stop.set()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.chaos.receiver",
                                     description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--db", required=True, help="SQLite file recording every request")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--parent-pid", type=int, default=0, help="exit when it is gone")
    args = parser.parse_args(argv)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    server = ThreadingHTTPServer(("127.0.0.1", args.port), _handler(_Records(args.db), stop))
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2},
                     daemon=True).start()
    if args.parent_pid:
        threading.Thread(target=_watch_parent, args=(args.parent_pid, stop), daemon=True).start()
    print(f"listening on http://127.0.0.1:{server.server_address[1]}", flush=True)
    stop.wait()
    server.shutdown()
    return 0


# -- the client side -------------------------------------------------------------------------


def send(base_url: str, body: dict[str, Any], *, timeout: float = 5.0) -> dict[str, Any]:
    request = urllib.request.Request(f"{base_url}/send", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        answer: dict[str, Any] = json.loads(response.read())
        return answer


def fetch_requests(base_url: str, *, timeout: float = 30.0) -> list[dict[str, Any]]:
    with urllib.request.urlopen(f"{base_url}/requests", timeout=timeout) as response:
        rows: list[dict[str, Any]] = json.loads(response.read())
        return rows


@contextlib.contextmanager
def running_receiver(folder: Path, *, start_timeout: float = 15.0) -> Iterator[str]:
    """Start the receiver process; yield its base URL; stop it (bounded) afterwards."""
    log = (folder / "receiver.log").open("wb")
    process = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.chaos.receiver", "--db",
         str(folder / "received.sqlite3"), "--parent-pid", str(os.getpid())],
        stdout=subprocess.PIPE, stderr=log, start_new_session=True,
        cwd=Path(__file__).resolve().parents[2])
    try:
        line = _read_line(process, start_timeout)
        if not line.startswith("listening on "):
            raise RuntimeError(f"receiver did not start: {line!r} "
                               f"(see {folder / 'receiver.log'})")
        yield line.removeprefix("listening on ").strip()
    finally:
        with contextlib.suppress(ProcessLookupError):
            process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)
        log.close()


def _read_line(process: subprocess.Popen[bytes], timeout: float) -> str:
    """The first line of ``process``'s stdout, waiting at most ``timeout`` seconds."""
    lines: list[bytes] = []
    stdout = process.stdout
    if stdout is None:
        return ""

    def read() -> None:
        lines.append(stdout.readline())

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout)
    return lines[0].decode(errors="replace") if lines else ""


if __name__ == "__main__":
    sys.exit(main())
