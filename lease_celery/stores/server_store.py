"""What the two SQL-server stores (PostgreSQL, MySQL) share above their drivers.

Both keep one list of connections per process, made on first use under a lock; both send
each lease operation as statements by name from their dialect's SQL file, with the injected
clock as ``%(now)s``; both judge a fenced write's refusal after a re-send against the row the
first send may have changed. Those rules, and the primitives that are one statement of the
same name on either server, are written here once. Each store keeps what is its own: the
driver and its errors (which are retried), its dialect's statements where they differ, the
claim's re-send logic and ``fenced``; the hooks it fills in are the abstract methods below.
"""

from __future__ import annotations

import abc
import random
import threading
import time
from collections.abc import Callable
from typing import Any, ClassVar, Generic, TypeVar

from ..app_connections import AppConnection, CheckedConnections
from ..errors import ConfigError, StoreError
from ..models import EffectState, HistoryEntry, Lease, LeaseState
from .base import Clock, Row, Store, fence_params
from .connection_list import ConnectionList
from .sql_glue import PerProcess, effect_find_query, find_query

__all__ = ["ServerStore"]

_T = TypeVar("_T")
_C = TypeVar("_C")  # the driver's connection
_L = TypeVar("_L", bound="ConnectionList[Any]")  # its list of connections


class ServerStore(Store, Generic[_C, _L]):
    """A lease store on a database server, reached through connections of this process."""

    #: The store's name in its messages ("postgres lease store at ..."), and the dialect an
    #: app's connection (``AppConnection.dialect``) must have to join a lease's transaction.
    dialect: ClassVar[str]
    #: Which database, on which server (two columns): an app's connection must reach the
    #: store's own (``lock_in`` and the other writes in the app's transaction).
    which_database: ClassVar[str]
    #: What the second column of ``which_database`` is called in a message.
    server_called: ClassVar[str]
    #: How the message refusing an app's connection of another dialect ends.
    other_dialect: ClassVar[str]

    _clock: Clock | None
    _where: str  # the server (or Django alias) in messages, never with a password
    _q: dict[str, str]  # the dialect's statements by name
    reconnect_timeout: float

    def _no_connections_yet(self) -> None:
        """No connection is made before the first use, in the process that uses it."""
        self._app_databases = CheckedConnections()
        self._connections: PerProcess[_L] = PerProcess()
        self._lock = threading.Lock()

    def _first_connection(self, connect: Callable[[], _C], prepare: Callable[[_C], None],
                          driver_error: type[BaseException], connections: Callable[[], _L]
                          ) -> _L:
        """This process's connections, opened by connecting once directly first: a bad host,
        password or database fails here with the server's own message (``driver_error`` as
        the store's ``StoreError``), and the schema is made (or checked, ``prepare``) once, on
        that connection, which the new list (``connections()``) then keeps."""
        try:
            conn = connect()
        except driver_error as exc:
            raise self._error(exc) from exc
        try:
            prepare(conn)
        except BaseException as exc:
            conn.close()  # type: ignore[attr-defined]  # every driver's connection has it
            if isinstance(exc, driver_error):
                raise self._error(exc) from exc
            raise
        opened = connections()
        opened.adopt(conn)  # the first statement needs no second connect
        return opened

    # -- hooks of each store ----------------------------------------------------------------

    @abc.abstractmethod
    def _open_connections(self) -> _L:
        """This process's connections, the schema made (or checked) on the first one."""

    @abc.abstractmethod
    def _run(self, operation: Callable[[_C], _T], *,
             if_resent: Callable[[_T], _T] | None = None) -> _T:
        """Run ``operation`` on a connection of its own; retry what the driver's errors say
        may be retried. ``if_resent`` corrects the result of a copy sent again after a
        connection error (the first send may have committed before its reply was lost)."""

    @staticmethod
    @abc.abstractmethod
    def _fetch_one(conn: _C, query: str, params: dict[str, Any]) -> Row | None:
        """The first row of ``query`` by column name, or None."""

    @staticmethod
    @abc.abstractmethod
    def _fetch_all(conn: _C, query: str, params: dict[str, Any]) -> list[Row]:
        """Every row of ``query`` by column name."""

    @staticmethod
    @abc.abstractmethod
    def _matches(conn: _C, query: str, params: dict[str, Any]) -> bool:
        """Whether a statement written for one row found it (PostgreSQL: the row it
        returns; MySQL: one row matched)."""

    @abc.abstractmethod
    def _database_of(self, conn: _C) -> tuple[Any, ...]:
        """``which_database``'s row, on one of the store's own connections."""

    @abc.abstractmethod
    def _at(self, conn: _C) -> float:
        """The store's instant read on ``conn``, as epoch seconds (``now()`` without an
        injected clock: the server's)."""

    def _queries_ready(self) -> None:
        """Before ``self._q`` is read outside ``_run``: where the statements depend on the
        server (MySQL's version), they are made with the first connection; by default
        they are ready from the start."""

    # -- connections ------------------------------------------------------------------------

    def _error(self, exc: BaseException) -> StoreError:
        return StoreError(f"{self.dialect} lease store at {self._where}: {exc}".strip())

    def _retry_pause(self, exc: Exception, attempt: int, started: float,
                     waited: float) -> float:
        """How long to sleep before trying an operation again after ``attempt`` failures
        (``exc`` the last), begun at ``perf_counter()`` ``started``, having slept ``waited``:
        jittered, growing up to a second, so that many workers meeting one outage do not
        come back at once. Past ``reconnect_timeout`` (counted in sleeps too: bounded even
        where a test freezes the clocks), the store's error instead."""
        spent = max(waited, time.perf_counter() - started)
        if spent >= self.reconnect_timeout:
            raise self._error(exc) from exc
        return min(self.reconnect_timeout - spent,
                   random.uniform(0.01, min(1.0, 0.05 * 2 ** min(attempt, 5))))

    def _get_connections(self) -> _L:
        # Every statement passes here: the lock is taken only while there are none (the
        # first use, and the first in a forked child), and they are made once under it.
        connections = self._connections.get()
        if connections is not None:
            return connections
        with self._lock:
            connections = self._connections.get()
            if connections is None:
                connections = self._open_connections()
                self._connections.set(connections)
            return connections

    def close(self) -> None:
        with self._lock:
            connections = self._connections.take()
            if connections is not None:
                connections.close()

    def now(self) -> float:
        if self._clock is not None:
            return self._clock()
        return self._run(self._at)

    # -- statements by name -----------------------------------------------------------------

    def _params(self, **params: Any) -> dict[str, Any]:
        params["now"] = self._clock() if self._clock is not None else None
        return params

    def _row(self, query: str, params: dict[str, Any]) -> Row | None:
        """One row of ``query`` by column name (None if none), on a connection of its own."""
        return self._run(lambda conn: self._fetch_one(conn, self._q[query], params))

    def _rows(self, query: str, params: dict[str, Any]) -> list[Row]:
        return self._run(lambda conn: self._fetch_all(conn, self._q[query], params))

    def _matched(self, query: str, **params: Any) -> bool:
        """Whether the one-row statement ``query`` found its row (the clock read per send)."""
        return self._run(lambda conn: self._matches(conn, self._q[query],
                                                    self._params(**params)))

    # -- primitives that are one statement of the same name on either server ----------------

    def _finish(self, lease: Lease, result: str, settle_within: float | None) -> bool:
        return self._fenced_write("finish", lease, LeaseState.DONE, result=result,
                                  settle_within=settle_within)

    def _release(self, lease: Lease, delay: float, reason: str | None, task: str | None,
                 counted: bool) -> bool:
        return self._fenced_write("release", lease, LeaseState.READY, delay=delay,
                                  reason=reason, task=task, given_back=0 if counted else 1)

    def _kill(self, lease: Lease, reason: str, settle_within: float | None,
              error: str | None) -> bool:
        return self._fenced_write("kill", lease, LeaseState.DEAD, reason=reason,
                                  settle_within=settle_within, error=error)

    def _fenced_write(self, query: str, lease: Lease, state: LeaseState, **params: Any) -> bool:
        """A fenced write; a refusal of a re-sent copy is checked against the row."""
        bound = self._params(**fence_params(lease), **params)

        def check(ok: bool) -> bool:
            return ok or self.settled_by(lease, state)

        # self._q read in the operation: MySQL's statements are made with its first connection.
        return self._run(lambda conn: self._matches(conn, self._q[query], bound),
                         if_resent=check)

    def _checkpoint(self, lease: Lease, data: str) -> bool:
        return self._matched("checkpoint", checkpoint=data, **fence_params(lease))

    def _force_release(self, key: str, reason: str) -> bool:
        return self._matched("force_release", key=key, reason=reason)

    def _requeue(self, key: str, reason: str) -> bool:
        return self._matched("requeue", key=key, reason=reason)

    def _purge(self, key: str) -> bool:
        return self._matched("purge", key=key)

    def _sweep_unmark(self, key: str, token: int) -> bool:
        return self._matched("sweep_unmark", key=key, token=token)

    def _get(self, key: str) -> Row | None:
        return self._row("get", {"key": key})

    def _find(self, state: LeaseState | None, prefix: str | None, owner: str | None,
              limit: int) -> list[Row]:
        return self._rows(find_query(state), {"prefix": prefix, "owner": owner, "limit": limit})

    def _stats(self) -> list[Row]:
        return self._rows("stats", self._params())

    def _limits(self, group: str | None, limit: int) -> list[Row]:
        return self._rows("limits_list", self._params(grp=group, limit=limit))

    def _history(self, key: str, limit: int) -> list[HistoryEntry]:
        return [HistoryEntry(**row)
                for row in self._rows("history_of", {"key": key, "limit": limit})]

    def _effect_get(self, key: str) -> Row | None:
        return self._row("effect_get", {"key": key})

    def _effect_find(self, state: EffectState | None, limit: int) -> list[Row]:
        return self._rows(effect_find_query(state),
                          {"state": None if state is None else state.value, "limit": limit})

    def _effect_update(self, key: str, version: int, state: EffectState,
                       result: str | None) -> bool:
        return self._matched("effect_update", key=key, version=version, state=state.value,
                             result=result)

    def _effect_delete(self, key: str, version: int) -> bool:
        return self._matched("effect_delete", key=key, version=version)

    # -- in the app's transaction (Store.lock_in, finish_in, record_published_in) ------------

    def _check_app_database(self, conn: AppConnection) -> None:
        if conn.dialect != self.dialect:
            raise ConfigError(f"{self.dialect} lease store at {self._where}: the app's "
                              f"connection is to a {conn.dialect} database{self.other_dialect}")
        if conn in self._app_databases:
            return  # checked on this connection before
        here = self._run(self._database_of)
        there = tuple(conn.execute(self.which_database, {})[0])
        if here != there:
            raise ConfigError(f"{self.dialect} lease store at {self._where}: the app's "
                              f"connection reaches database {there[0]!r} ({self.server_called} "
                              f"{there[1]}), but the store is in {here[0]!r} "
                              f"({self.server_called} {here[1]}); the lease can only join a "
                              "transaction on its own database")
        self._app_databases.add(conn)

    def _app_lock(self, conn: AppConnection, lease: Lease) -> bool:
        self._queries_ready()
        return bool(conn.execute(self._q["lock_current"], self._params(**fence_params(lease))))
