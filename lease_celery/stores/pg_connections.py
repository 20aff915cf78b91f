"""The PostgreSQL store's connections: the list of ``connection_list`` (which says why a list
and not ``psycopg_pool``) with psycopg's ways of closing a connection and of telling whether
one is as it was taken or was closed by the server while idle.

An idle connection past ``CHECK_IDLE_AFTER`` is polled before use (a syscall, no round trip):
a server that closed it (its idle timeout, a restart) has left something to read.
"""

from __future__ import annotations

import select
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from ..extras import needs
from .connection_list import ConnectionList, NoConnection

with needs("the PostgreSQL lease store", "psycopg 3", extra="postgres"):
    import psycopg
    from psycopg import pq

__all__ = ["Connections", "NoConnection"]


class Connections(ConnectionList[psycopg.Connection[Any]]):
    """Connections to one server for the threads of one process."""

    def __init__(self, conninfo: str, *, max_size: int,
                 connect: Callable[[], psycopg.Connection[Any]] | None = None) -> None:
        self._conninfo = conninfo
        # ``connect``: what makes a new autocommit connection (the Django integration hands
        # over its backend's, which applies the project's DATABASES settings).
        super().__init__(connect or self._connect_conninfo, max_size=max_size)

    def _connect_conninfo(self) -> psycopg.Connection[Any]:
        return psycopg.connect(self._conninfo, autocommit=True)

    def _close(self, conn: psycopg.Connection[Any]) -> None:
        conn.close()

    def _as_taken(self, conn: psycopg.Connection[Any]) -> bool:
        return not conn.closed and conn.info.transaction_status == pq.TransactionStatus.IDLE

    def _closed_by_server(self, conn: psycopg.Connection[Any]) -> bool:
        return _closed_by_server(conn)

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
