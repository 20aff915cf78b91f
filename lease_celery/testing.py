"""Helpers for testing code that uses lease_celery: a clock you move by hand, a scratch store,
and a scratch store for an app's LeasedTasks.

    from lease_celery.testing import ManualClock, scratch_store

    clock = ManualClock(1_000.0)
    with scratch_store(clock=clock) as store:
        lease = store.claim("report:1", owner="me", ttl=10)
        clock.advance(10)                       # expires_at <= now: expired
        assert store.finish(lease, "late") is False

Your own tasks, in eager mode or called directly, against a store of the test's own (the
default SQLite file keeps its rows between runs, so a second run of a key finds it done):

    with scratch_leases(app) as store:
        assert report.delay(42).get() == ...
        assert store.get("report:42").state is LeaseState.DONE

With pytest, the fixtures ``lease_clock`` (a ManualClock) and ``lease_store`` (a scratch store
on it) come with the package (its ``pytest11`` entry point).
"""

from __future__ import annotations

import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from .apps import leased_tasks
from .stores.base import Clock, Store
from .stores.registry import open_store, share_store, unshare_store

__all__ = ["ManualClock", "scratch_leases", "scratch_store"]


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


@contextmanager
def scratch_leases(app: Any, *, clock: Clock | None = None) -> Iterator[Store]:
    """Point every LeasedTask of ``app`` at a scratch SQLite store for the block (their own
    ``lease_store_url`` attributes and the app's setting both), on ``clock`` if given; yield
    that store. Eager runs, direct calls and ``apply()`` then claim and finish there, and the
    next block starts empty. Restored on exit."""
    with scratch_store(clock=clock) as store:
        tasks = [type(task) for task in leased_tasks(app)]
        saved = [(cls, cls.__dict__.get("lease_store_url")) for cls in tasks]
        had_setting = "lease_store_url" in app.conf
        previous = app.conf.get("lease_store_url")
        share_store(store)
        try:
            app.conf.lease_store_url = store.url
            for cls in tasks:
                cls.lease_store_url = store.url
                cls._resolve_lease_settings(app)
            yield store
        finally:
            unshare_store(store.url)
            if had_setting:
                app.conf.lease_store_url = previous
            else:
                app.conf.pop("lease_store_url", None)
            for cls, own in saved:
                if own is None:
                    del cls.lease_store_url
                else:
                    cls.lease_store_url = own
                cls._resolve_lease_settings(app)
