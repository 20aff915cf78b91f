"""The MySQL store's connections: idle ones in a plain list, at most ``pool_max`` in use.

As ``pg_connections``: every lease operation takes a connection for itself and gives it back;
``pop``/``append`` on a list are atomic, a semaphore bounds the connections in use. A
connection goes back only as it was taken (autocommit, no transaction open); any other, and
every idle one after a connection error (they most likely died with it: a server restart, a
proxy's cut), is closed. One per process (the store keeps it in a ``PerProcess``).

A connection idle for more than ``CHECK_IDLE_AFTER`` is pinged before use (one round trip,
skipped on a busy worker): a server that closed it (``wait_timeout``, a restart) is found
then, and a fresh one is made instead of sending a statement into a dead socket, whose error
would leave the store unsure whether the statement ran.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any

from ..extras import needs

with needs("the MySQL lease store", "PyMySQL", extra="mysql"):
    import pymysql
    from pymysql.constants import SERVER_STATUS

__all__ = ["CHECK_IDLE_AFTER", "Connections", "NoConnection"]

#: Seconds a connection may sit idle and still be used without pinging it first.
CHECK_IDLE_AFTER = 1.0

Connection = Any  # pymysql.connections.Connection (untyped package)


class NoConnection(Exception):
    """Every connection was in use for as long as the caller could wait."""


class Connections:
    """Connections to one server for the threads of one process."""

    def __init__(self, connect: Callable[[], Connection], *, max_size: int) -> None:
        self._connect = connect
        self._idle: list[tuple[Connection, float]] = []
        self._slots = threading.BoundedSemaphore(max_size)
        self._closed = False

    def take(self, timeout: float) -> Connection:
        """A connection for the caller alone, until ``give_back``: an idle one, or a new one
        (``NoConnection`` after ``timeout`` seconds with all in use; a failed connect raises
        PyMySQL's error)."""
        if not self._slots.acquire(timeout=max(timeout, 0.0)):
            raise NoConnection(f"all connections stayed in use for {timeout:.2f}s")
        try:
            while True:
                try:
                    conn, since = self._idle.pop()
                except IndexError:
                    return self._connect()
                if time.monotonic() - since > CHECK_IDLE_AFTER and _closed_by_server(conn):
                    _close(conn)
                    continue
                return conn
        except BaseException:
            self._slots.release()
            raise

    def give_back(self, conn: Connection, *, broken: bool = False) -> None:
        """End the caller's use of ``conn``: kept if it is as it was taken, else closed
        (``broken``: a connection error; every idle one goes too)."""
        try:
            if broken:
                _close(conn)
                self.close_idle()
            elif (self._closed or not conn.open or conn.get_autocommit() is not True
                  or conn.server_status & SERVER_STATUS.SERVER_STATUS_IN_TRANS):
                _close(conn)
            else:
                self._idle.append((conn, time.monotonic()))
        finally:
            self._slots.release()

    def adopt(self, conn: Connection) -> None:
        """Keep ``conn``, made by the caller (autocommit, no transaction open), as idle."""
        self._idle.append((conn, time.monotonic()))

    def close_idle(self) -> None:
        idle, self._idle = self._idle, []
        for conn, _ in idle:
            _close(conn)

    def close(self) -> None:
        self._closed = True
        self.close_idle()


def _close(conn: Connection) -> None:
    # PyMySQL's close() sends COM_QUIT and drops the socket even when that fails; it refuses
    # only a connection closed already.
    with contextlib.suppress(pymysql.Error):
        conn.close()


def _closed_by_server(conn: Connection) -> bool:
    """Whether an idle connection is dead (the server closed it, or it does not answer)."""
    if not conn.open:
        return True
    try:
        conn.ping(reconnect=False)
    except (pymysql.Error, OSError):
        return True
    return False
