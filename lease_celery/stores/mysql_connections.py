"""The MySQL store's connections: the list of ``connection_list`` with PyMySQL's ways of
closing a connection and of telling whether one is as it was taken or was closed by the
server while idle.

An idle connection past ``CHECK_IDLE_AFTER`` is pinged before use (one round trip, skipped on
a busy worker): a server that closed it (``wait_timeout``, a restart) is found then.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from ..extras import needs
from .connection_list import ConnectionList, NoConnection

with needs("the MySQL lease store", "PyMySQL", extra="mysql"):
    import pymysql
    from pymysql.constants import SERVER_STATUS

__all__ = ["Connection", "Connections", "NoConnection"]

Connection = Any  # pymysql.connections.Connection (untyped package)


class Connections(ConnectionList[Connection]):
    """Connections to one server for the threads of one process."""

    def __init__(self, connect: Callable[[], Connection], *, max_size: int) -> None:
        super().__init__(connect, max_size=max_size)

    def _close(self, conn: Connection) -> None:
        # PyMySQL's close() sends COM_QUIT and drops the socket even when that fails; it
        # refuses only a connection closed already.
        with contextlib.suppress(pymysql.Error):
            conn.close()

    def _as_taken(self, conn: Connection) -> bool:
        return bool(conn.open and conn.get_autocommit() is True
                    and not conn.server_status & SERVER_STATUS.SERVER_STATUS_IN_TRANS)

    def _closed_by_server(self, conn: Connection) -> bool:
        """Whether an idle connection is dead (the server closed it, or it does not answer)."""
        if not conn.open:
            return True
        try:
            conn.ping(reconnect=False)
        except (pymysql.Error, OSError):
            return True
        return False
