"""The SQL-server stores' connections: idle ones in a plain list, at most ``pool_max`` in use.

Every lease operation is one statement (or one short transaction) on a connection taken for
it and given back. Through ``psycopg_pool`` a checkout and its return cost about 25 µs of CPU
per statement, measured here (``pool.connection()``: its lock, its statistics, the
connection's own context manager, which commits an autocommit connection; 66 µs a trivial
statement against 40 µs on a kept connection, psycopg 3.3, alternating bursts in one process),
and a task makes two. This keeps idle connections in a list (``pop``/``append`` are atomic)
and bounds the connections in use with a semaphore, as ``psycopg_pool`` bounded them with
``max_size``.

A connection goes back to the list only in the state it was taken in (autocommit, no
transaction open, not closed); any other is closed. A connection error closes every idle
connection too: they most likely died with it (a server restart, a proxy's cut), and the
store's re-send then goes out on a fresh one. A connection idle for more than
``CHECK_IDLE_AFTER`` is checked before use: a server that closed it (its idle timeout, a
restart) is found then, and a fresh one is made instead of sending a statement into a dead
socket, whose error would leave the store unsure whether the statement ran.

The rule is written once here; what differs by driver (how to close a connection, whether
one is as it was taken, whether an idle one was closed by the server) is three small hooks
of each driver's subclass (``pg_connections``, ``mysql_connections``). One list per process
(the store keeps it in a ``PerProcess``): a forked child makes its own.
"""

from __future__ import annotations

import abc
import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

__all__ = ["CHECK_IDLE_AFTER", "ConnectionList", "NoConnection"]

#: Seconds a connection may sit idle and still be used without checking it first. A busy
#: worker reuses its connections within milliseconds: the check (a syscall, or a round trip)
#: is then skipped.
CHECK_IDLE_AFTER = 1.0

_C = TypeVar("_C")


class NoConnection(Exception):
    """Every connection was in use for as long as the caller could wait."""


class ConnectionList(abc.ABC, Generic[_C]):
    """Connections to one server for the threads of one process."""

    def __init__(self, connect: Callable[[], _C], *, max_size: int) -> None:
        # ``connect``: what makes a new connection, its session as the store expects (the
        # Django integration hands over its backend's, which applies the project's settings).
        self._connect = connect
        self._idle: list[tuple[_C, float]] = []
        self._slots = threading.BoundedSemaphore(max_size)
        self._closed = False

    # -- the driver's differences -----------------------------------------------------------

    @abc.abstractmethod
    def _close(self, conn: _C) -> None:
        """Close ``conn`` (one closed already, or broken, included)."""

    @abc.abstractmethod
    def _as_taken(self, conn: _C) -> bool:
        """Whether ``conn`` is as it was taken: open, autocommit, no transaction open."""

    @abc.abstractmethod
    def _closed_by_server(self, conn: _C) -> bool:
        """Whether an idle ``conn`` is not to be used as it is (the server closed it)."""

    # -- the list -----------------------------------------------------------------------------

    def take(self, timeout: float) -> _C:
        """A connection for the caller alone, until ``give_back``: an idle one, or a new one.

        Waits up to ``timeout`` seconds while ``max_size`` are in use (``NoConnection``);
        a failed connect raises the driver's error."""
        if not self._slots.acquire(timeout=max(timeout, 0.0)):
            raise NoConnection(f"all connections stayed in use for {timeout:.2f}s")
        try:
            while True:
                try:
                    conn, since = self._idle.pop()
                except IndexError:
                    return self._connect()
                if time.monotonic() - since > CHECK_IDLE_AFTER and self._closed_by_server(conn):
                    self._close(conn)
                    continue
                return conn
        except BaseException:
            self._slots.release()
            raise

    def give_back(self, conn: _C, *, broken: bool = False) -> None:
        """End the caller's use of ``conn``: kept for the next caller if it is as it was
        taken, closed otherwise (``broken``: a connection error; every idle one goes too)."""
        try:
            if broken:
                self._close(conn)
                self.close_idle()
            elif self._closed or not self._as_taken(conn):
                self._close(conn)
            else:
                self._idle.append((conn, time.monotonic()))
        finally:
            self._slots.release()

    def adopt(self, conn: _C) -> None:
        """Keep ``conn``, made by the caller (autocommit, no transaction open), as idle."""
        self._idle.append((conn, time.monotonic()))

    def close_idle(self) -> None:
        """Close the idle connections (in use ones close when they are given back)."""
        idle, self._idle = self._idle, []
        for conn, _ in idle:
            self._close(conn)

    def close(self) -> None:
        self._closed = True
        self.close_idle()
