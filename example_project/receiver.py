"""The outside service: a tiny HTTP server, in a process of its own, that keeps a record of
every request it receives (a SQLite file), so duplicate effects are counted by the receiver,
not by the sender.

``python -m example_project.receiver --db received.sqlite3 [--port 0]`` prints
``listening on http://127.0.0.1:PORT`` as its first line. ``POST /reports`` takes
``{"key": ..., "report": {...}}``; ``GET /requests?edition=E`` lists what was received.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import sqlite3
import sys
import threading
import time
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = ["Received", "main", "received"]

Received = dict[str, Any]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS received (
    received_at REAL NOT NULL, key TEXT NOT NULL, edition TEXT NOT NULL,
    report_id INTEGER NOT NULL, fingerprint TEXT NOT NULL, sender TEXT NOT NULL)
"""


class _Records:
    def __init__(self, path: str) -> None:
        self._conn = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._conn.execute(_SCHEMA)
        self._lock = threading.Lock()

    def add(self, key: str, report: dict[str, Any], sender: str) -> int:
        canonical = json.dumps(report, sort_keys=True, separators=(",", ":")).encode()
        with self._lock:
            self._conn.execute(
                "INSERT INTO received VALUES (?, ?, ?, ?, ?, ?)",
                (time.time(), key, str(report["edition"]), int(report["report_id"]),
                 hashlib.sha256(canonical).hexdigest()[:16], sender))
            row = self._conn.execute("SELECT count(*) FROM received WHERE key = ?",
                                     (key,)).fetchone()
        return int(row[0])

    def list(self, edition: str) -> list[Received]:
        with self._lock:
            rows = self._conn.execute(
                "SELECT received_at, key, report_id, fingerprint, sender FROM received "
                "WHERE edition = ? ORDER BY received_at", (edition,)).fetchall()
        return [{"received_at": r[0], "key": r[1], "report_id": r[2], "fingerprint": r[3],
                 "sender": r[4]} for r in rows]


def _handler(records: _Records) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # (http.server's naming)
            if self.path != "/reports":
                self._reply(404, {"error": "not found"})
                return
            length = int(self.headers.get("Content-Length", "0"))
            try:
                body = json.loads(self.rfile.read(length))
                count = records.add(body["key"], body["report"],
                                    self.headers.get("X-Sender", "unknown"))
            except (ValueError, KeyError, TypeError) as exc:
                self._reply(400, {"error": f"bad request: {exc!r}"})
                return
            self._reply(200, {"key": body["key"], "times_received": count})

        def do_GET(self) -> None:
            url = urllib.parse.urlsplit(self.path)
            if url.path == "/requests":
                edition = urllib.parse.parse_qs(url.query).get("edition", [""])[0]
                self._reply(200, records.list(edition))
            elif url.path == "/health":
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


def received(base_url: str, edition: str, *, timeout: float = 5.0) -> list[Received]:
    """Ask the service what it received for ``edition`` (oldest first)."""
    query = urllib.parse.urlencode({"edition": edition})
    with urllib.request.urlopen(f"{base_url}/requests?{query}", timeout=timeout) as response:
        result: list[Received] = json.loads(response.read())
        return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m example_project.receiver",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--db", required=True, help="SQLite file recording every request")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    args = parser.parse_args(argv)
    server = ThreadingHTTPServer(("127.0.0.1", args.port), _handler(_Records(args.db)))
    print(f"listening on http://127.0.0.1:{server.server_address[1]}", flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        server.serve_forever(poll_interval=0.2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
