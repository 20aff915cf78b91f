"""The SQLite store's wait for a busy write lock stays bounded by ``busy_timeout`` however
many attempts it takes (a writer stalled for seconds, as the chaos run's SIGSTOP does)."""

from __future__ import annotations

import sqlite3
import threading
import time
from pathlib import Path

import pytest

from lease_celery import open_store
from lease_celery.errors import StoreBusy


def test_thousands_of_busy_attempts_end_in_store_busy_not_an_overflow(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Chaos run f15869b3 on SQLite: a claim waiting ~3 s behind a stopped writer made over
    1,024 attempts, and ``0.0001 * 2 ** attempt`` raised OverflowError, which failed the
    task (a second result write for its id). The sleeps here are free, so the attempts pile
    up quickly; the wait must end with StoreBusy at busy_timeout, or succeed."""
    store = open_store(f"sqlite:///{tmp_path / 'busy.sqlite3'}?busy_timeout=30")
    slept: list[float] = []
    this_thread, real_sleep = threading.get_ident(), time.sleep

    def sleep(seconds: float) -> None:
        # time.sleep is patched for every thread: another test's threads in this process
        # (a history writer, a heartbeat) sleep for real, and are not counted.
        if threading.get_ident() == this_thread:
            slept.append(seconds)
        else:
            real_sleep(seconds)

    monkeypatch.setattr("lease_celery.stores.sqlite.time.sleep", sleep)
    attempts = [0]

    def always_busy() -> None:
        attempts[0] += 1
        raise sqlite3.OperationalError("database is locked")

    with pytest.raises(StoreBusy, match="stayed locked"):
        store._retry_busy(always_busy)  # type: ignore[attr-defined]
    assert attempts[0] > 1100  # precondition: past the point where 2 ** attempt overflowed
    assert 29.9 <= sum(slept) <= 30.0 + 1e-9
    store.close()
