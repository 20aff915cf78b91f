"""The PostgreSQL store's connections: idle ones in a plain list, at most ``pool_max`` in use.

Every lease operation is one statement on a connection taken for it and given back. Through
``psycopg_pool`` a checkout and its return cost about 25 µs of CPU per statement, measured
here (``pool.connection()``: its lock, its statistics, the connection's own context manager,
which commits an autocommit connection; 66 µs a trivial statement against 40 µs on a kept
connection, psycopg 3.3, alternating bursts in one process), and a task makes two. This keeps
idle connections in a list (``pop``/``append`` are atomic) and bounds the connections in use
with a semaphore, as ``psycopg_pool`` bounded them with ``max_size``.

A connection goes back to the list only in the state it was taken in (autocommit, no
transaction open, not closed); any other is closed. A connection error closes every idle
connection too: they most likely died with it (a server restart, a proxy's cut), and the
store's re-send then goes out on a fresh one. A connection idle for more than
``CHECK_IDLE_AFTER`` is polled before use: a server that closed it (its idle timeout, a
restart) has left something to read, and a fresh one is made instead.

One per process (the store keeps it in a ``PerProcess``): a forked child makes its own.
"""

from __future__ import annotations

import select
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from ..extras import needs

with needs("the PostgreSQL lease store", "psycopg 3", extra="postgres"):
    import psycopg
    from psycopg import pq

__all__ = ["CHECK_IDLE_AFTER", "Connections", "NoConnection"]

#: Seconds a connection may sit idle and still be used without polling it first. A busy
#: worker reuses its connections within milliseconds: the poll, a syscall, is then skipped.
CHECK_IDLE_AFTER = 1.0


class NoConnection(Exception):
    """Every connection was in use for as long as the caller could wait."""


class Connections:
    """Connections to one server for the threads of one process."""

    def __init__(self, conninfo: str, *, max_size: int,
                 connect: Callable[[], psycopg.Connection[Any]] | None = None) -> None:
        self._conninfo = conninfo
        # ``connect``: what makes a new autocommit connection (the Django integration hands
        # over its backend's, which applies the project's DATABASES settings).
        self._connect = connect or self._connect_conninfo
        self._idle: list[tuple[psycopg.Connection[Any], float]] = []
        self._slots = threading.BoundedSemaphore(max_size)
        self._closed = False

    def take(self, timeout: float) -> psycopg.Connection[Any]:
        """A connection for the caller alone, until ``give_back``: an idle one, or a new one.

        Waits up to ``timeout`` seconds while ``max_size`` are in use (``NoConnection``);
        a failed connect raises psycopg's ``OperationalError``."""
        if not self._slots.acquire(timeout=max(timeout, 0.0)):
            raise NoConnection(f"all connections stayed in use for {timeout:.2f}s")
        try:
            while True:
                try:
                    conn, since = self._idle.pop()
                except IndexError:
                    return self._connect()
                if time.monotonic() - since > CHECK_IDLE_AFTER and _closed_by_server(conn):
                    conn.close()
                    continue
                return conn
        except BaseException:
            self._slots.release()
            raise

    def _connect_conninfo(self) -> psycopg.Connection[Any]:
        return psycopg.connect(self._conninfo, autocommit=True)

    def give_back(self, conn: psycopg.Connection[Any], *, broken: bool = False) -> None:
        """End the caller's use of ``conn``: kept for the next caller if it is as it was
        taken, closed otherwise (``broken``: a connection error; every idle one goes too)."""
        try:
            if broken:
                conn.close()
                self.close_idle()
            elif (self._closed or conn.closed
                  or conn.info.transaction_status != pq.TransactionStatus.IDLE):
                conn.close()
            else:
                self._idle.append((conn, time.monotonic()))
        finally:
            self._slots.release()

    @contextmanager
    def connection(self, timeout: float) -> Iterator[psycopg.Connection[Any]]:
        """``take`` and ``give_back`` around a block (a transaction of the caller's own)."""
        conn = self.take(timeout)
        try:
            yield conn
        except BaseException as exc:
            self.give_back(conn, broken=isinstance(exc, psycopg.OperationalError))
            raise
        self.give_back(conn)

    def adopt(self, conn: psycopg.Connection[Any]) -> None:
        """Keep ``conn``, made by the caller (autocommit, no transaction open), as idle."""
        self._idle.append((conn, time.monotonic()))

    def close_idle(self) -> None:
        """Close the idle connections (in use ones close when they are given back)."""
        idle, self._idle = self._idle, []
        for conn, _ in idle:
            conn.close()

    def close(self) -> None:
        self._closed = True
        self.close_idle()


def _closed_by_server(conn: psycopg.Connection[Any]) -> bool:
    """Whether an idle connection has something to read: the server closed it (or sent a
    notice nobody asked for): either way it is not used as it is."""
    if conn.closed:
        return True
    try:
        fd = conn.fileno()
        if hasattr(select, "poll"):  # any descriptor number (select() stops at 1024)
            poller = select.poll()
            poller.register(fd, select.POLLIN)
            return bool(poller.poll(0))
        readable, _, _ = select.select([fd], [], [], 0)
    except (OSError, ValueError, psycopg.Error):
        return True
    return bool(readable)
