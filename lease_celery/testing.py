"""Helpers for testing code that uses lease_celery: a clock you move by hand, a scratch store.

    from lease_celery.testing import ManualClock, scratch_store

    clock = ManualClock(1_000.0)
    with scratch_store(clock=clock) as store:
        lease = store.claim("report:1", owner="me", ttl=10)
        clock.advance(10)                       # expires_at <= now: expired
        assert store.finish(lease, "late") is False
"""

from __future__ import annotations

import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .stores.base import Clock, Store
from .stores.registry import open_store

__all__ = ["ManualClock", "scratch_store"]


class ManualClock:
    """An authority clock that only moves when told to (epoch seconds); thread-safe."""

    def __init__(self, now: float = 1_000_000.0) -> None:
        self._now = float(now)
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            return self._now

    @property
    def now(self) -> float:
        return self()

    @now.setter
    def now(self, value: float) -> None:
        self.set(value)

    def advance(self, seconds: float) -> float:
        """Move forward by ``seconds`` (never backwards); return the new time."""
        if seconds < 0:
            raise ValueError(f"a clock does not go backwards (advance by {seconds})")
        with self._lock:
            self._now += seconds
            return self._now

    def set(self, now: float) -> None:
        """Jump to ``now`` (not earlier than the current time)."""
        with self._lock:
            if now < self._now:
                raise ValueError(f"a clock does not go backwards ({now} < {self._now})")
            self._now = float(now)


@contextmanager
def scratch_store(url: str | None = None, *, clock: Clock | None = None) -> Iterator[Store]:
    """A store for one test: by default a SQLite file in a temporary directory, removed after.

    Pass ``url`` to use another store (give it a schema or prefix of the test's own).
    """
    with tempfile.TemporaryDirectory(prefix="lease-celery-test-") as tmp:
        store = open_store(url or f"sqlite:///{Path(tmp) / 'leases.sqlite3'}", clock=clock)
        try:
            yield store
        finally:
            store.close()
