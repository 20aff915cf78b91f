"""A redis-server of a test's own: loopback, a free port, files in the test's folder, and a
restart on the same port (with or without what it had on disk)."""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import redis

from tests.support.policy_helpers import free_port
from tests.support.servers import require

#: What a durable Redis store runs with: every acknowledged write is on disk.
DURABLE = ("--appendonly", "yes", "--appendfsync", "always")


class PrivateRedis:
    """One redis-server process, started with ``options`` after ``--save ""`` and
    ``--appendonly no`` (so without options it keeps nothing across a restart)."""

    def __init__(self, folder: Path, *options: str) -> None:
        binary = shutil.which("redis-server")
        require("redis-server", binary is not None, "no redis-server on PATH")
        assert binary is not None
        self.binary, self.folder, self.options = binary, folder, options
        self.port = free_port()
        self.server: subprocess.Popen[bytes] | None = None

    def url(self, prefix: str = "private:") -> str:
        return f"redis://127.0.0.1:{self.port}/0?prefix={prefix}"

    def start(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        self.server = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.folder), *self.options],
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        client = redis.Redis(port=self.port, socket_connect_timeout=1)
        deadline = time.monotonic() + 10
        try:
            while True:
                try:
                    client.ping()
                    return
                except (redis.ConnectionError, redis.BusyLoadingError):
                    if time.monotonic() > deadline or self.server.poll() is not None:
                        raise AssertionError(f"redis-server {self.options} did not start"
                                             ) from None
                    time.sleep(0.05)
        finally:
            client.close()

    def stop(self) -> None:
        if self.server is not None:
            self.server.terminate()
            self.server.wait(10)
            self.server = None

    def restart(self) -> None:
        """Stop and start again on the same port: it comes back with what its options kept
        on disk (nothing, without persistence)."""
        self.stop()
        self.start()


@contextmanager
def private_redis(folder: Path, *options: str, prefix: str = "doctor:") -> Iterator[str]:
    """A started ``PrivateRedis``; yields a lease store URL on it."""
    server = PrivateRedis(folder, *options)
    server.start()
    try:
        yield server.url(prefix)
    finally:
        server.stop()
