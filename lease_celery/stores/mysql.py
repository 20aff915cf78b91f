"""MySQL and MariaDB store: for teams whose database is MySQL (``mysql://`` or ``mariadb://``).

Every decision is taken by the server, on the server's clock (``UNIX_TIMESTAMP(SYSDATE(6))``
read in the statement that judges the row, on a session whose time zone is UTC). Sessions run
autocommit at READ COMMITTED: a lease operation that is one statement (claim, renew, finish,
release, kill, purge, checkpoint) is its own transaction, history row included (a trigger);
the few that are several (limited claims, sweeps, retention, receipts started under a lease,
``fenced``) open one. READ COMMITTED, not InnoDB's default REPEATABLE READ: no gap or
next-key locks, so a sweep's range read never blocks a claim of a new key, and a locking read
judges the latest committed row, never a snapshot.

A broken connection (killed, server restarted) is replaced and the operation tried again
until ``reconnect_timeout`` runs out, as on PostgreSQL; a deadlock or a lock wait timeout
(InnoDB rolls the transaction back) is tried again within the same bound.
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar
from urllib.parse import unquote, urlsplit

from ..app_connections import AppConnection
from ..checks import check_ttl
from ..errors import ConfigError
from ..extras import needs
from ..limits import Rate
from ..models import Finding, HistoryEntry, Lease, LeaseState
from .base import (
    Clock,
    Row,
    check_lease,
    fence_params,
    lease_not_current,
    lease_params,
)
from .mysql_diagnosis import server_findings
from .queries import load_queries
from .server_store import ServerStore
from .sql_glue import (
    find_queries,
    find_query,
    grouped,
    purge_in_batches,
)
from .urls import number_option, server_address, url_options, whole_option

with needs("the MySQL lease store", "PyMySQL", extra="mysql"):
    import pymysql
    from pymysql.constants import CLIENT, SERVER_STATUS

    from .mysql_connections import Connection, Connections, NoConnection

__all__ = ["MySQLStore", "schema_queries"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

#: URL options that configure the store; connect_timeout and unix_socket go to PyMySQL.
_OPTIONS = {"pool_max": "4", "reconnect_timeout": "10", "lock_wait_timeout": "10",
            "connect_timeout": "5"}
_PASSED_ON = ("unix_socket",)

#: Server errors after which the connection is gone (the statement may or may not have run):
#: can't connect, server gone away, lost connection, server shutting down, connection killed
#: (MariaDB), idle connection closed (MySQL 8).
_CONNECTION_ERRORS = frozenset({2002, 2003, 2006, 2013, 2055, 1053, 1927, 4031})
#: InnoDB rolled the transaction back (deadlock) or the statement (lock wait timeout): both
#: wrote nothing, and are tried again.
_LOCK_ERRORS = frozenset({1213, 1205})

#: Which database, on which server: an app's connection must reach the store's own.
_WHICH_DATABASE = "SELECT DATABASE() AS db, CONCAT(@@hostname, ':', @@port) AS server"

#: The clock: the injected one, else the server's as UTC epoch seconds (mysql.sql explains).
_NOW = "COALESCE(%(now)s, UNIX_TIMESTAMP(NOW(6)))"
_CLOCK = "COALESCE(%(now)s, UNIX_TIMESTAMP(SYSDATE(6)))"


def _error_code(exc: BaseException) -> int | None:
    args = getattr(exc, "args", ())
    return args[0] if args and isinstance(args[0], int) else None


def _connection_lost(exc: BaseException) -> bool:
    return isinstance(exc, pymysql.err.InterfaceError) or (
        isinstance(exc, pymysql.err.OperationalError) and _error_code(exc) in _CONNECTION_ERRORS)


def _execute(conn: Connection, query: str, params: dict[str, Any]) -> int:
    with conn.cursor() as cur:
        return int(cur.execute(query, params))


def _one(conn: Connection, query: str, params: dict[str, Any]) -> Row | None:
    with conn.cursor() as cur:
        cur.execute(query, params)
        row: Row | None = cur.fetchone()
        return row


def _all(conn: Connection, query: str, params: dict[str, Any]) -> list[Row]:
    with conn.cursor() as cur:
        cur.execute(query, params)
        return list(cur.fetchall())


class MySQLStore(ServerStore[Connection, Connections]):
    """Lease store on MySQL 8 or MariaDB 10.6+ (``mysql://user:password@host:3306/db``).

    URL options: ``pool_max`` (connections per process, default 4), ``reconnect_timeout``
    (seconds, default 10), ``lock_wait_timeout`` (InnoDB's, seconds, default 10: how long a
    statement waits for a row another transaction holds, a ``fenced`` block's), and PyMySQL's
    ``connect_timeout`` (default 5) and ``unix_socket``. The database must exist; the store
    makes its tables in it. Any other option, or one given twice, is a ``ConfigError``.
    """

    carries_finish = False
    dialect = "mysql"
    which_database = _WHICH_DATABASE
    server_called = "server"
    other_dialect = "; the lease can only join a transaction on its own database"

    def __init__(self, url: str, *, clock: Clock | None = None) -> None:
        self.url = url
        self._clock = clock
        parts = urlsplit(url)
        self._where = server_address("mysql", parts, 3306)
        shown = f"{parts.scheme}://{self._where}"  # messages never show the password
        query = url_options("mysql", parts, shown, _OPTIONS, passed_on=_PASSED_ON,
                            passed_to="PyMySQL")
        options = {name: query.pop(name, default) for name, default in _OPTIONS.items()}
        self.database = unquote(parts.path.lstrip("/"))
        if not self.database or "/" in self.database:
            raise ConfigError(f"mysql URL {shown!r} must name one database: "
                              "mysql://user:password@host:3306/database")
        self.pool_max = whole_option("mysql", "pool_max", options["pool_max"], minimum=1)
        self.reconnect_timeout = check_ttl(
            number_option(shown, "reconnect_timeout", options["reconnect_timeout"], 10.0),
            name="mysql reconnect_timeout")
        lock_wait = whole_option("mysql", "lock_wait_timeout", options["lock_wait_timeout"],
                                 minimum=1)
        self._connect_args: dict[str, Any] = {
            "host": parts.hostname or "localhost", "port": parts.port or 3306,
            "user": unquote(parts.username or ""), "password": unquote(parts.password or ""),
            "database": self.database, "charset": "utf8mb4", "autocommit": True,
            "connect_timeout": whole_option("mysql", "connect_timeout",
                                            options["connect_timeout"], minimum=1),
            # Affected rows = rows matched: a renewal on a clock that has not moved changes no
            # column, and is still a renewal. Several statements in one request: the claim
            # sends its transaction as one batch (the parameters are escaped by PyMySQL as
            # for one statement; nothing but the store's own SQL is sent on these).
            "client_flag": CLIENT.FOUND_ROWS | CLIENT.MULTI_STATEMENTS,
            "cursorclass": pymysql.cursors.DictCursor,
            **{name: query[name] for name in _PASSED_ON if name in query},
        }
        self._session = (f"SET SESSION time_zone = '+00:00', innodb_lock_wait_timeout = "
                         f"{lock_wait}", "SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED")
        self._q: dict[str, str] = {}  # made with the first connection (the server's version)
        self._no_connections_yet()

    # -- connections ------------------------------------------------------------------------

    def _connect(self) -> Connection:
        """A new connection, its session set as every statement of the store expects."""
        conn = pymysql.connect(**self._connect_args)
        try:
            with conn.cursor() as cur:
                for statement in self._session:
                    cur.execute(statement)
        except BaseException:
            conn.close()
            raise
        return conn

    def _open_connections(self) -> Connections:
        """This process's connections, the schema made (or checked) on the first one."""
        return self._first_connection(
            self._connect, self._prepare, pymysql.Error,
            lambda: Connections(self._connect, max_size=self.pool_max))

    def _prepare(self, conn: Connection) -> None:
        """The queries for this server's dialect, and the schema (made or checked) once."""
        with conn.cursor() as cur:
            cur.execute("SELECT VERSION() AS version")
            version = str(cur.fetchone()["version"])
        queries = schema_queries(version)
        queries.update(find_queries(queries))
        # find() of any state: the settled rows as two arms, done and dead, each a range of
        # the (state, updated_at) index read backwards; one arm for both states (the other
        # stores' partial index) would sort every settled row (433 ms at a million, 1 ms so).
        arms = [queries[find_query(state)] for state in LeaseState]
        queries[find_query(None)] = queries["list_merge"].replace(
            "{arms}", " UNION ALL ".join(f"({arm})" for arm in arms))
        queries["claim_batch"] = (f"START TRANSACTION;\n{queries['claim']};\n"
                                  f"{queries['claimed_by']};\nCOMMIT")
        self._make_schema(conn, queries)
        self._q = queries

    def _make_schema(self, conn: Connection, queries: dict[str, str]) -> None:
        """Make, migrate or check the schema (a store whose schema is made by others, Django's
        migrations, only checks it)."""
        from .mysql_schema import make_schema

        make_schema(conn, queries, f"mysql lease store at {self._where}")

    def _run(self, operation: Callable[[Connection], _T], *,
             if_resent: Callable[[_T], _T] | None = None, transaction: bool = False) -> _T:
        """Run ``operation`` on a connection of its own (in a transaction if asked); replace
        broken connections and try again, and deadlocks and lock timeouts too.

        A statement that failed with a connection error may have committed before its reply
        was lost; its re-sent copy is then judged against the row the first one changed. When
        that happened, ``if_resent`` gets the re-sent copy's result to correct it.
        """
        started = time.perf_counter()
        waited = 0.0
        attempt = 0
        maybe_sent = False
        while True:
            connections = self._get_connections()
            try:
                conn = connections.take(self.reconnect_timeout)
                try:
                    if transaction:
                        conn.begin()
                    result = operation(conn)
                    if transaction:
                        conn.commit()
                except BaseException as exc:
                    lost = _connection_lost(exc)
                    if not lost and (transaction or _in_transaction(conn)):
                        _rollback(conn)  # a batch's own transaction too (the claim's)
                    connections.give_back(conn, broken=lost)
                    raise
                connections.give_back(conn)
                return if_resent(result) if maybe_sent and if_resent is not None else result
            except (pymysql.Error, NoConnection) as exc:
                retried = isinstance(exc, NoConnection) or _connection_lost(exc) or (
                    _error_code(exc) in _LOCK_ERRORS)
                if not retried:
                    raise self._error(exc) from exc
                maybe_sent = maybe_sent or (_connection_lost(exc) and not transaction)
                attempt += 1
                pause = self._retry_pause(exc, attempt, started, waited)
                logger.warning("mysql lease store at %s: %s; trying again", self._where, exc)
                time.sleep(pause)
                waited += pause

    _fetch_one = staticmethod(_one)
    _fetch_all = staticmethod(_all)

    @staticmethod
    def _matches(conn: Connection, query: str, params: dict[str, Any]) -> bool:
        return _execute(conn, query, params) == 1

    def _database_of(self, conn: Connection) -> tuple[Any, ...]:
        found = _one(conn, _WHICH_DATABASE, {})
        assert found is not None  # a SELECT of two values answers one row
        return found["db"], found["server"]

    def _queries_ready(self) -> None:
        self._get_connections()  # the queries for this server

    def _count(self, query: str, **params: Any) -> int:
        """Rows a one-statement write matched."""
        return self._run(lambda conn: _execute(conn, self._q[query], self._params(**params)))

    def _at(self, conn: Connection) -> float:
        # Read once for a transaction that needs one value, the injected clock's if any.
        row = _one(conn, self._q["now"], self._params())
        assert row is not None
        return float(row["now"])

    # -- primitives (Store checks and decodes; these only talk to the server) ---------------

    def _claim(self, key: str, owner: str, ttl: float, task: str | None) -> Row | None:
        params = self._params(key=key, owner=owner, ttl=ttl, task=task, nonce=uuid.uuid4().hex,
                              grp=None, slot=None)
        # One batch, one round trip: START TRANSACTION, the upsert, the read-back, COMMIT. In a
        # transaction, the upsert's row lock holds until the row is read back, so the lease
        # answered is the claim's own (a renewal of the claim in flight, by this process's
        # heartbeat, could otherwise land in between: the chaos full run met one).
        return self._run(self._once_claimed(
            lambda conn: _claim_in(conn, self._q, params), params))

    def _once_claimed(self, claim: Callable[[Connection], Row | None],
                      params: dict[str, Any]) -> Callable[[Connection], Row | None]:
        """``claim``, run again after a failure only if its first run did not take the row.

        A claim whose COMMIT's reply was lost (a connection killed, a server restarted) may
        have committed; sent again after its lease expired (a restart outlasts a 2 s ttl), it
        would take over its own row, and one call would have handed out two tokens. So every run but
        the first asks the row first: the first run's nonce on it is that run's lease (expired
        or not: the caller judges it as any lease), else the claim is sent again."""
        runs = 0

        def once(conn: Connection) -> Row | None:
            nonlocal runs
            runs += 1
            if runs > 1:
                won = _one(conn, self._q["claimed_by"], params)
                if won is not None:  # a limited claim's row answers as granted
                    return won if params["grp"] is None else {**won, "verdict": "granted"}
            return claim(conn)

        return once

    def _claim_limited(self, key: str, owner: str, ttl: float, task: str | None, group: str,
                       limit: int | None, rate: Rate | None) -> Row | None:
        from .mysql_limits import claim_limited

        params = self._params(key=key, owner=owner, ttl=ttl, task=task, nonce=uuid.uuid4().hex,
                              grp=group, limit=limit, rate=None if rate is None else rate.text,
                              interval=None if rate is None else rate.interval)

        def claim(conn: Connection) -> Row | None:
            return claim_limited(conn, self._q, params, self._at(conn))

        # A transaction: a failure before COMMIT rolled it back, one during COMMIT may not.
        return self._run(self._once_claimed(claim, params), transaction=True)

    def _hand_on(self, group: str | None, grace: float, limit: int) -> list[Row]:
        from .mysql_limits import hand_on

        return self._run(lambda conn: hand_on(conn, self._q, group, grace, limit,
                                              self._at(conn)), transaction=True)

    def _set_limit(self, group: str, changes: dict[str, Any]) -> None:
        self._count("limit_set", grp=group, set_limit=changes.get("set_limit"),
                    set_rate=changes.get("set_rate"), set_interval=changes.get("set_interval"),
                    change_limit="set_limit" in changes, change_rate="set_rate" in changes)

    def _record_published(self, key: str, task: str, countdown: float) -> bool:
        params = self._params(key=key, task=task, countdown=countdown, nonce=uuid.uuid4().hex)

        def publish(conn: Connection) -> bool:
            _execute(conn, self._q["record_published"], params)
            return _one(conn, self._q["published_already"], params) is not None

        return self._run(publish)

    def _renew_many(self, leases: Sequence[Lease], ttl: float) -> list[Row | None]:
        def renew(conn: Connection) -> list[Row | None]:
            at = self._at(conn)
            out: list[Row | None] = []
            for lease in leases:
                params = self._params(**fence_params(lease), ttl=ttl, at=at)
                renewed = _execute(conn, self._q["renew"], params)
                out.append(_one(conn, self._q["renewed"], params) if renewed else None)
            return out

        return self._run(renew, transaction=True)

    def _settle_many(self, leases: Sequence[Lease]) -> list[bool]:
        def settle(conn: Connection) -> list[bool]:
            out = []
            for lease in leases:
                params = self._params(**fence_params(lease))
                out.append(_execute(conn, self._q["settle"], params) == 1
                           or _one(conn, self._q["settled_by_owner"], params) is not None)
            return out

        # No transaction: each confirmation is its own statement, idempotent (a lease that
        # settled its row already is found by settled_by_owner), and the task's path is
        # two round trips shorter.
        return self._run(settle)

    def _claim_settlement(self, key: str, owner: str, ttl: float) -> Row | None:
        params = self._params(key=key, owner=owner, ttl=ttl, nonce=uuid.uuid4().hex)

        def claim(conn: Connection) -> Row | None:
            _execute(conn, self._q["claim_settlement"], params)
            return _one(conn, self._q["settlement_claimed_by"], params)

        # A transaction, as a claim's: the row read back is the one this call wrote.
        return self._run(claim, transaction=True)

    def _cancel(self, key: str, reason: str) -> bool:
        params = self._params(key=key, reason=reason, nonce=uuid.uuid4().hex)

        def cancel(conn: Connection) -> bool:
            if _execute(conn, self._q["cancel_held"], params):
                return True
            _execute(conn, self._q["cancel_idle"], params)
            row = _one(conn, self._q["cancel_state"], params)
            return row is not None and row["nonce"] == params["nonce"]

        return self._run(cancel)

    def _purge_older_than(self, seconds: float, limit: int | None) -> int:
        def batch(size: int) -> int:
            def purge(conn: Connection) -> int:
                params = self._params(seconds=seconds, limit=size)
                keys = [row["key"] for row in _all(conn, self._q["purge_old_candidates"],
                                                   params)]
                if not keys:
                    return 0
                return _execute(conn, _in(self._q["purge_old"], "keys", len(keys)),
                                {**params, **_listed("keys", keys)})

            return self._run(purge, transaction=True)

        # Small transactions: no row lock is held for a whole table's worth.
        return purge_in_batches(batch, limit)

    def _sweep_expired(self, limit: int, grace: float, nonce: str) -> list[str]:
        def sweep(conn: Connection) -> list[str]:
            params = self._params(limit=limit, grace=grace, nonce=nonce, at=self._at(conn))
            keys = [row["key"] for row in _all(conn, self._q["sweep_candidates"], params)]
            if keys:
                _execute(conn, _in(self._q["sweep_mark"], "keys", len(keys)),
                         {**params, **_listed("keys", keys)})
            return keys

        return self._run(sweep, transaction=True)

    def _record_history_many(self, entries: list[HistoryEntry]) -> None:
        rows = [(e.key, e.at, e.event, e.owner, e.token, e.fence, e.detail) for e in entries]

        def insert(conn: Connection) -> None:
            with conn.cursor() as cur:
                cur.executemany(self._q["history_insert"], rows)

        self._run(insert)

    def _history_many(self, keys: list[str], limit: int) -> dict[str, list[HistoryEntry]]:
        if not keys:
            return {}
        rows = self._run(lambda conn: _all(conn, _in(self._q["history_many"], "keys", len(keys)),
                                           {"limit": limit, **_listed("keys", keys)}))
        return grouped(HistoryEntry(**row) for row in rows)

    def _recent_history(self, events: list[str] | None, limit: int) -> list[HistoryEntry]:
        if events is None:
            query = self._q["history_recent"].replace("{events}", "TRUE")
            params: dict[str, Any] = {"limit": limit}
        elif not events:
            return []
        else:
            query = self._q["history_recent"].replace(
                "{events}", "event IN (" + _placeholders("events", len(events)) + ")")
            params = {"limit": limit, **_listed("events", events)}
        return [HistoryEntry(**row) for row in self._run(lambda conn: _all(conn, query, params))]

    def _prune_history(self, cutoff: float, limit: int) -> int:
        return self._run(lambda conn: _execute(conn, self._q["history_prune"],
                                               {"cutoff": cutoff, "limit": limit}))

    def _diagnose(self) -> list[Finding]:
        return self._run(server_findings)

    # -- effect receipts --------------------------------------------------------------------

    def _effect_insert(self, key: str, fingerprint: str, lease: Lease | None) -> bool | None:
        return self._effect_started("effect_insert", lease,
                                    {"key": key, "fingerprint": fingerprint})

    def _effect_restart(self, key: str, version: int, lease: Lease | None) -> bool | None:
        return self._effect_started("effect_restart", lease, {"key": key, "version": version})

    def _effect_started(self, query: str, lease: Lease | None,
                        params: dict[str, Any]) -> bool | None:
        """A receipt write started by ``lease``, in one transaction with the check (under a
        shared lock on the lease's row) that the lease is current: None if it is not."""
        bound = self._params(**params, **lease_params(lease))

        def write(conn: Connection) -> bool | None:
            if lease is not None and _one(conn, self._q["is_current"], self._params(
                    **fence_params(lease))) is None:
                return None
            return _execute(conn, self._q[query], bound) == 1

        return self._run(write, transaction=lease is not None)

    # -- the app's own transaction (issue 39: Store.lock_in, finish_in, record_published_in) -

    def _app_finish(self, conn: AppConnection, lease: Lease, result: str,
                    settle_within: float | None) -> bool:
        self._queries_ready()
        # The app's session may count changed rows, not matched ones: a finish always changes
        # the state, so either count is 1 exactly when it was accepted.
        return conn.changed(self._q["finish"], self._params(
            **fence_params(lease), result=result, settle_within=settle_within)) == 1

    def _app_record_published(self, conn: AppConnection, key: str, task: str,
                              countdown: float) -> bool:
        self._queries_ready()
        params = self._params(key=key, task=task, countdown=countdown, nonce=uuid.uuid4().hex)
        conn.changed(self._q["record_published"], params)
        return bool(conn.execute(self._q["published_already"], params))

    @contextmanager
    def fenced(self, lease: Lease) -> Iterator[Connection]:
        """A transaction in which ``lease`` is verified current, under a lock on its row.

        Write your own rows (tables in the store's database, or another database on the same
        server) through the yielded PyMySQL connection: they commit only if the lease is
        still current at commit (checked again then), and no claim can take the key over
        while the transaction is open. Raises ``LeaseLost`` (and rolls back) otherwise. The
        connection's session is the store's (READ COMMITTED, UTC, several statements allowed
        in one request): pass values as parameters, never spliced into the SQL.
        """
        params = self._params(**fence_params(check_lease(lease)))
        connections = self._get_connections()
        try:
            conn = connections.take(self.reconnect_timeout)
        except (pymysql.Error, NoConnection) as exc:
            raise self._error(exc) from exc
        try:
            conn.begin()
            self._verify(conn, lease, params, "before the fenced writes")
            yield conn
            self._verify(conn, lease, params, "at commit")
            conn.commit()
        except BaseException as exc:
            lost = _connection_lost(exc)
            if not lost:
                _rollback(conn)
            connections.give_back(conn, broken=lost)
            if isinstance(exc, pymysql.Error):
                raise self._error(exc) from exc
            raise
        connections.give_back(conn)

    def _verify(self, conn: Connection, lease: Lease, params: dict[str, Any],
                when: str) -> None:
        if _one(conn, self._q["lock_current"], params) is None:
            raise lease_not_current(lease, when, what="committed")


def schema_queries(version: str) -> dict[str, str]:
    """The store's statements for the server of ``version`` (``SELECT VERSION()``), as its
    connections run them: for the schema made elsewhere too (Django's migrations)."""
    from .mysql_schema import dialect_queries

    return dialect_queries(load_queries("mysql"), version, now=_NOW, clock=_CLOCK)


def _claim_in(conn: Connection, queries: dict[str, str], params: dict[str, Any]) -> Row | None:
    """The claim batch (``claim_batch``: the claim statement and the read-back of the row it
    took by this call's nonce, in one transaction): that row, if it took one. Every result of
    the batch is read, or the connection would be out of step with the server."""
    row: Row | None = None
    with conn.cursor() as cur:
        cur.execute(queries["claim_batch"], params)
        while True:
            if cur.description:
                row = cur.fetchone()
            if not cur.nextset():
                return row


def _in_transaction(conn: Connection) -> bool:
    return bool(conn.server_status & SERVER_STATUS.SERVER_STATUS_IN_TRANS)


def _rollback(conn: Connection) -> None:
    # A failed rollback leaves the connection not idle: given back, it is closed.
    with contextlib.suppress(pymysql.Error, OSError):
        conn.rollback()


def _placeholders(name: str, count: int) -> str:
    return ", ".join(f"%({name}{i})s" for i in range(count))


def _in(query: str, name: str, count: int) -> str:
    """``query`` with ``{name}`` replaced by ``count`` placeholders (an IN list)."""
    return query.replace("{" + name + "}", _placeholders(name, count))


def _listed(name: str, values: Sequence[Any]) -> dict[str, Any]:
    return {f"{name}{i}": value for i, value in enumerate(values)}
