"""PostgreSQL store: the recommended store when workers span machines.

Every decision is taken by the server inside one statement, on the server's clock
(``clock_timestamp()``). The connections belong to one process (``pg_connections``), made
lazily in the process that uses them (those inherited through ``fork()`` are abandoned, never
used or closed by the child). A broken connection (backend terminated, server restarted) is
replaced and the operation tried again until ``reconnect_timeout`` runs out.
"""

from __future__ import annotations

import functools
import logging
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Protocol, TypeVar
from urllib.parse import quote, urlencode, urlsplit

from ..app_connections import AppConnection
from ..checks import check_ttl
from ..errors import ConfigError, StoreError
from ..extras import needs
from ..limits import Rate
from ..models import HistoryEntry, Lease, LeaseState
from .base import Clock, Row, check_lease, fence_params, lease_not_current, lease_params
from .queries import load_queries
from .server_store import ServerStore
from .sql_glue import (
    SCHEMA_VERSION,
    check_schema_version,
    find_queries,
    grouped,
    purge_in_batches,
)
from .urls import choice_option, number_option, server_address, url_options, whole_option

# The extra depends on psycopg alone, as psycopg's maintainers advise libraries to: the
# application chooses its implementation (the system's libpq, or psycopg[binary]).
with needs("the PostgreSQL lease store", "psycopg 3", extra="postgres",
           if_broken="psycopg is installed but loads no libpq: install the system's libpq "
                     "(Debian: apt-get install libpq5) or psycopg's own build: "
                     "pip install 'psycopg[binary]'"):
    import psycopg
    from psycopg.conninfo import conninfo_to_dict
    from psycopg.rows import dict_row

    from .pg_connections import Connections, NoConnection

__all__ = ["PostgresStore", "create_schema", "schema_queries", "stored_schema_version"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

#: URL options that configure the store rather than the connection.
_OPTIONS = {"schema": "public", "pool_max": "4", "reconnect_timeout": "10"}
#: Which database a connection reaches: the app's must be the store's (Store.lock_in).
_WHICH_DATABASE = "SELECT current_database(), inet_server_port()"
_SSLMODES = ("disable", "allow", "prefer", "require", "verify-ca", "verify-full")


def _one(conn: psycopg.Connection[Any], query: str, params: dict[str, Any]) -> Row | None:
    return conn.cursor(row_factory=dict_row).execute(query, params).fetchone()


def _all(conn: psycopg.Connection[Any], query: str, params: dict[str, Any]) -> list[Row]:
    return list(conn.cursor(row_factory=dict_row).execute(query, params).fetchall())


class PostgresStore(ServerStore[psycopg.Connection[Any], Connections]):
    """Lease store on PostgreSQL (``postgresql://user@host:port/db``).

    URL options besides libpq's own: ``schema`` (default ``public``), ``pool_max`` (default 4
    connections per process), ``reconnect_timeout`` (seconds, default 10). ``connect_timeout``
    defaults to 5 seconds. Any other option, or one given twice, is a ``ConfigError`` naming
    it, raised without connecting.
    """

    carries_finish = True  # finish_and_claim: one statement, one commit
    dialect = "postgres"
    which_database = _WHICH_DATABASE
    server_called = "port"
    other_dialect = ", not this store's"

    def __init__(self, url: str, *, clock: Clock | None = None) -> None:
        self.url = url
        self._clock = clock
        parts = urlsplit(url)
        self._where = (server_address("postgres", parts, 5432) if parts.hostname or parts.port
                       else f"the local socket, database {parts.path[1:] or '(default)'}")
        shown = f"postgresql://{self._where}"  # messages never show the password
        query = url_options("postgres", parts, shown, _OPTIONS, passed_on=_libpq_options(),
                            passed_to="libpq")
        options = {name: query.pop(name, default) for name, default in _OPTIONS.items()}
        # The libpq options a store relies on are checked here rather than at the first
        # connection, so that check_url (a host that only publishes tasks) refuses them too.
        query.setdefault("connect_timeout", "5")
        self._connect_timeout = whole_option("postgres", "connect_timeout",
                                             query["connect_timeout"], minimum=0)
        if "sslmode" in query:
            query["sslmode"] = choice_option("postgres", "sslmode", query["sslmode"], _SSLMODES)
        self.schema = options["schema"]
        if not self.schema.replace("_", "").isalnum():
            raise ConfigError(f"postgres URL option schema={self.schema!r} must be a plain "
                              "identifier (letters, digits, underscores)")
        self.pool_max = whole_option("postgres", "pool_max", options["pool_max"], minimum=1)
        self.reconnect_timeout = check_ttl(
            number_option(shown, "reconnect_timeout", options["reconnect_timeout"], 10.0),
            name="postgres reconnect_timeout")
        scheme = "postgresql"
        # quote, not quote_plus: libpq does not read "+" as a space (options=-c%20name%3Dvalue).
        # Built by hand: urlunsplit drops the "//" of a URL with no host (postgresql:///db,
        # libpq's local socket), and libpq then reads the whole URL as one keyword.
        encoded = urlencode(query, quote_via=quote)
        self._conninfo = f"{scheme}://{parts.netloc}{parts.path}" + (
            f"?{encoded}" if encoded else "")
        try:
            conninfo_to_dict(self._conninfo)  # libpq's own parser: no connection is made
        except psycopg.Error as exc:
            raise ConfigError(f"postgres lease store URL {shown!r} is not usable: {exc}"
                              ) from exc
        self._prepare()

    def _prepare(self) -> None:
        """The queries for ``self.schema`` and no connection yet (made in the first use)."""
        self._q = schema_queries(self.schema)
        self._q.update(find_queries(self._q))
        self._q["finish_and_claim"] = carrying_claim(self._q["finish"], self._q["claim"])
        self._no_connections_yet()

    # -- connections ------------------------------------------------------------------------

    def _open_connections(self) -> Connections:
        """This process's connections, the schema made (or checked) on the first one."""
        def make_schema(conn: psycopg.Connection[Any]) -> None:
            with conn.transaction():
                create_schema(conn, self._q, self.schema,
                              f"postgres lease store at {self._where}")

        return self._first_connection(
            lambda: psycopg.connect(self._conninfo, autocommit=True), make_schema, psycopg.Error,
            lambda: Connections(self._conninfo, max_size=self.pool_max))

    def _run(self, operation: Callable[[psycopg.Connection[Any]], _T], *,
             if_resent: Callable[[_T], _T] | None = None,
             look_first: Callable[[psycopg.Connection[Any]], _T | None] | None = None) -> _T:
        """Run ``operation`` on a connection of its own; replace broken connections and retry.

        A statement that failed with a connection error may have committed before its reply
        was lost; its re-sent copy is then judged against the row the first one changed. When
        that happened, ``if_resent`` gets the re-sent copy's result to correct it, and
        ``look_first`` is asked before the copy is sent: what it finds (not None) is the first
        send's answer, and nothing is sent again.
        """
        started = time.perf_counter()
        waited = 0.0  # sleeps added up: bounded even where a test freezes the clocks
        attempt = 0
        maybe_sent = False
        while True:
            connections = self._get_connections()
            try:
                # Connections.connection() by hand: every statement passes here, and a
                # generator context manager would cost each a few µs more.
                conn = connections.take(self.reconnect_timeout)
                try:
                    found = look_first(conn) if maybe_sent and look_first is not None else None
                    if found is not None:
                        connections.give_back(conn)
                        return found
                    result = operation(conn)
                except BaseException as exc:
                    # A connection error closes the idle ones too: they most likely died with it.
                    connections.give_back(conn, broken=isinstance(exc, psycopg.OperationalError))
                    raise
                connections.give_back(conn)
                return if_resent(result) if maybe_sent and if_resent is not None else result
            except (psycopg.OperationalError, NoConnection) as exc:
                maybe_sent = maybe_sent or isinstance(exc, psycopg.OperationalError)
                attempt += 1
                pause = self._retry_pause(exc, attempt, started, waited)
                logger.warning("postgres lease store at %s: %s; reconnecting", self._where, exc)
                time.sleep(pause)
                waited += pause
            except psycopg.Error as exc:
                raise StoreError(f"postgres lease store at {self._where}: {exc}") from exc

    _fetch_one = staticmethod(_one)
    _fetch_all = staticmethod(_all)

    @staticmethod
    def _matches(conn: psycopg.Connection[Any], query: str, params: dict[str, Any]) -> bool:
        return conn.execute(query, params).fetchone() is not None

    def _database_of(self, conn: psycopg.Connection[Any]) -> tuple[Any, ...]:
        return tuple(conn.execute(_WHICH_DATABASE).fetchone() or ())

    # -- primitives (Store checks and decodes; these only talk to the server) ---------------

    def _claim(self, key: str, owner: str, ttl: float, task: str | None) -> Row | None:
        params = self._params(key=key, owner=owner, ttl=ttl, task=task, nonce=uuid.uuid4().hex)

        def claimed_by(row: Row | None) -> Row | None:
            # Refused after a re-send: did the first send win? Its nonce would be on the row.
            return row or self._row("claimed_by", params)

        # Asked before a re-send too: once the first send's lease has expired, the copy would
        # take that row over (a second token, a takeover nobody made) instead of being refused.
        return self._run(lambda conn: _one(conn, self._q["claim"], params),
                         if_resent=claimed_by, look_first=self._claimed_by(params))

    def _finish_and_claim(self, finished: Lease, result: str, key: str, owner: str,
                          ttl: float, task: str | None) -> tuple[bool, Row | None]:
        params = self._params(key=key, owner=owner, ttl=ttl, task=task, nonce=uuid.uuid4().hex,
                              finished_key=finished.key, finished_owner=finished.owner,
                              finished_token=finished.token, result=result, settle_within=None)

        def both(conn: psycopg.Connection[Any]) -> tuple[bool, Row | None]:
            row = _one(conn, self._q["finish_and_claim"], params)
            assert row is not None  # the statement always answers one row
            claimed = None if row["token"] is None else row
            return bool(row["finished"]), claimed

        def resent(answer: tuple[bool, Row | None]) -> tuple[bool, Row | None]:
            # Refusals of a re-sent copy are checked against the rows the first send wrote.
            accepted, claimed = answer
            return (accepted or self.settled_by(finished, LeaseState.DONE),
                    claimed or self._row("claimed_by", params))

        return self._run(both, if_resent=resent)

    def _claim_limited(self, key: str, owner: str, ttl: float, task: str | None, group: str,
                       limit: int | None, rate: Rate | None) -> Row | None:
        params = self._params(key=key, owner=owner, ttl=ttl, task=task, nonce=uuid.uuid4().hex,
                              grp=group, limit=limit, rate=None if rate is None else rate.text,
                              interval=None if rate is None else rate.interval)

        def claimed_by(row: Row | None) -> Row | None:
            # Refused after a re-send: did the first send win? Its nonce would be on the row.
            if row is not None:
                return row
            won = self._row("claimed_by", params)
            return None if won is None else {**won, "verdict": "granted"}

        def claim(conn: psycopg.Connection[Any]) -> Row | None:
            row = _one(conn, self._q["claim_limited"], params)
            return None if row is None or row["verdict"] is None else row

        def won_before(conn: psycopg.Connection[Any]) -> Row | None:
            won = self._claimed_by(params)(conn)
            return None if won is None else {**won, "verdict": "granted"}

        return self._run(claim, if_resent=claimed_by, look_first=won_before)

    def _claimed_by(self, params: dict[str, Any]
                    ) -> Callable[[psycopg.Connection[Any]], Row | None]:
        """Has this very claim call (its nonce) won already, its reply lost?"""
        return lambda conn: _one(conn, self._q["claimed_by"], params)

    def _hand_on(self, group: str | None, grace: float, limit: int) -> list[Row]:
        return self._rows("hand_on", self._params(grp=group, grace=grace, limit=limit))

    def _set_limit(self, group: str, changes: dict[str, Any]) -> None:
        params = self._params(grp=group, set_limit=changes.get("set_limit"),
                              set_rate=changes.get("set_rate"),
                              set_interval=changes.get("set_interval"),
                              change_limit="set_limit" in changes,
                              change_rate="set_rate" in changes)
        self._run(lambda conn: conn.execute(self._q["limit_set"], params))

    def _record_published(self, key: str, task: str, countdown: float) -> bool:
        params = self._params(key=key, task=task, countdown=countdown)

        def published_already(row: Row | None) -> Row | None:
            # A re-send after a lost reply finds the first send's row.
            return row or self._row("published_already", params)

        row = self._run(lambda conn: _one(conn, self._q["record_published"], params),
                        if_resent=published_already)
        return row is not None

    def _renew_many(self, leases: Sequence[Lease], ttl: float) -> list[Row | None]:
        rows = self._rows("renew_many", self._params(
            ttl=ttl, keys=[lease.key for lease in leases],
            owners=[lease.owner for lease in leases],
            tokens=[lease.token for lease in leases]))
        renewed = {(row["key"], row["owner"], int(row["token"])): row for row in rows}
        return [renewed.get((lease.key, lease.owner, lease.token)) for lease in leases]

    def _settle_many(self, leases: Sequence[Lease]) -> list[bool]:
        bound = self._params(keys=[lease.key for lease in leases],
                             owners=[lease.owner for lease in leases],
                             tokens=[lease.token for lease in leases])

        def settle(conn: psycopg.Connection[Any]) -> set[tuple[str, str, int]]:
            rows = conn.execute(self._q["settle_many"], bound).fetchall()
            return {(key, owner, int(token)) for key, owner, token in rows}

        def settled_already(done: set[tuple[str, str, int]]) -> set[tuple[str, str, int]]:
            # A settled row keeps the owner and token that settled it: a lease asking again
            # (the confirmation is idempotent), or a re-send whose first send settled it.
            rows = self._run(lambda conn: conn.execute(
                self._q["settled_by_owner"], bound).fetchall())
            return done | {(key, owner, int(token)) for key, owner, token in rows}

        settled = self._run(settle, if_resent=settled_already)
        if len(settled) < len({(lease.key, lease.owner, lease.token) for lease in leases}):
            settled = settled_already(settled)
        return [(lease.key, lease.owner, lease.token) in settled for lease in leases]

    def _claim_settlement(self, key: str, owner: str, ttl: float) -> Row | None:
        params = self._params(key=key, owner=owner, ttl=ttl, nonce=uuid.uuid4().hex)

        def claimed_by(row: Row | None) -> Row | None:
            return row or self._row("settlement_claimed_by", params)

        return self._run(lambda conn: _one(conn, self._q["claim_settlement"], params),
                         if_resent=claimed_by)

    def _cancel(self, key: str, reason: str) -> bool:
        # Re-sent after a lost reply, the cancel finds its own effect (a dead or cancelling
        # row): answered False then, which only under-reports; the row is as asked.
        return self._matched("cancel", key=key, reason=reason)

    def _purge_older_than(self, seconds: float, limit: int | None) -> int:
        # Small statements: no row lock is held for a whole table's worth.
        return purge_in_batches(lambda size: len(self._run(lambda conn: conn.execute(
            self._q["purge_old"], self._params(seconds=seconds, limit=size)).fetchall())), limit)

    def _sweep_expired(self, limit: int, grace: float, nonce: str) -> list[str]:
        params = self._params(limit=limit, grace=grace, nonce=nonce)

        def sweep(conn: psycopg.Connection[Any]) -> list[Any]:
            return conn.execute(self._q["sweep"], params).fetchall()

        def swept_already(rows: list[Any]) -> list[Any]:
            return rows or self._run(
                lambda conn: conn.execute(self._q["swept_already"], params).fetchall())

        return [key for (key,) in self._run(sweep, if_resent=swept_already)]

    def _record_history_many(self, entries: list[HistoryEntry]) -> None:
        columns = {"keys": [e.key for e in entries], "ats": [e.at for e in entries],
                   "events": [e.event for e in entries], "owners": [e.owner for e in entries],
                   "tokens": [e.token for e in entries], "fences": [e.fence for e in entries],
                   "details": [e.detail for e in entries]}
        self._run(lambda conn: conn.execute(self._q["history_insert_many"], columns))

    def _history_many(self, keys: list[str], limit: int) -> dict[str, list[HistoryEntry]]:
        return grouped(HistoryEntry(**row)
                       for row in self._rows("history_many", {"keys": keys, "limit": limit}))

    def _recent_history(self, events: list[str] | None, limit: int) -> list[HistoryEntry]:
        return [HistoryEntry(**row)
                for row in self._rows("history_recent", {"events": events, "limit": limit})]

    def _prune_history(self, cutoff: float, limit: int) -> int:
        return int(self._run(lambda conn: conn.execute(
            self._q["history_prune"], {"cutoff": cutoff, "limit": limit}).rowcount))

    def _at(self, conn: psycopg.Connection[Any]) -> float:
        row = conn.execute(self._q["now"], {"now": None}).fetchone()
        assert row is not None
        return float(row[0])

    # -- effect receipts --------------------------------------------------------------------

    def _effect_insert(self, key: str, fingerprint: str, lease: Lease | None) -> bool | None:
        return self._matched("effect_insert", key=key, fingerprint=fingerprint,
                             **lease_params(lease)) or self._still_current(lease)

    def _effect_restart(self, key: str, version: int, lease: Lease | None) -> bool | None:
        return self._matched("effect_restart", key=key, version=version,
                             **lease_params(lease)) or self._still_current(lease)

    def _still_current(self, lease: Lease | None) -> bool | None:
        """After a refused receipt write: False if its lease is current, None if not."""
        if lease is not None and not self._matched("is_current", **fence_params(lease)):
            return None
        return False

    # -- in the app's transaction (Store.lock_in, finish_in, record_published_in) ------------

    def _app_finish(self, conn: AppConnection, lease: Lease, result: str,
                    settle_within: float | None) -> bool:
        return bool(conn.execute(self._q["finish"], self._params(
            **fence_params(lease), result=result, settle_within=settle_within)))

    def _app_record_published(self, conn: AppConnection, key: str, task: str,
                              countdown: float) -> bool:
        return bool(conn.execute(self._q["record_published"],
                                 self._params(key=key, task=task, countdown=countdown)))

    @contextmanager
    def fenced(self, lease: Lease) -> Iterator[psycopg.Connection[Any]]:
        """A transaction in which ``lease`` is verified current, under a lock on its row.

        Write your own rows through the yielded connection: they commit only if the lease is
        still current at commit (checked again then), and no claim can take the key over
        while the transaction is open. Raises ``LeaseLost`` (and rolls back) otherwise.
        """
        params = fence_params(check_lease(lease))
        connections = self._get_connections()
        try:
            with connections.connection(self.reconnect_timeout) as conn, conn.transaction():
                self._verify(conn, lease, params, "before the fenced writes")
                yield conn
                self._verify(conn, lease, params, "at commit")
        except (psycopg.OperationalError, NoConnection) as exc:
            raise self._error(exc) from exc

    def _verify(self, conn: psycopg.Connection[Any], lease: Lease, params: dict[str, Any],
                when: str) -> None:
        try:
            row = conn.execute(self._q["lock_current"], self._params(**params)).fetchone()
        except psycopg.Error as exc:
            raise StoreError(f"postgres lease store at {self._where}: {exc}") from exc
        if row is None:
            raise lease_not_current(lease, when, what="committed")


class Executes(Protocol):
    """What the schema's statements run on: a psycopg connection, or a DB-API cursor's
    adapter (the Django migration's)."""

    def execute(self, query: str, params: dict[str, Any] | None = None) -> Any: ...


def create_schema(conn: Executes, queries: dict[str, str], schema: str, where: str) -> None:
    """The store's schema made, or migrated to ``SCHEMA_VERSION``, in the caller's
    transaction: the store's first connection runs it, and so do the Django app's
    migrations (``lease_celery.contrib.django``), so there is one definition of the schema.
    ``queries``: the dialect's queries with ``{schema}`` put in; ``where``: for messages."""
    # The advisory lock serialises many workers starting at once.
    conn.execute(queries["lock_schema"])
    if schema != "public":
        conn.execute(queries["create_schema"])
    for name in ("create_leases", "create_effects", "create_fence", "create_meta",
                 "create_history", "create_limits", "create_waiters"):
        conn.execute(queries[name])
    row = conn.execute(queries["get_schema_version"]).fetchone()
    version = None if row is None else int(row[0])
    check_schema_version(version, where)
    if version == SCHEMA_VERSION:
        return  # no DDL: it would lock the table against running workers
    if version is not None:
        # From any older schema (sql_glue.SCHEMA_VERSION says what each added): new
        # columns only; no row is rewritten but schema 1's.
        conn.execute(queries["migrate_columns"])
        if version < 2:
            conn.execute(queries["migrate_fill_sweep_at"])
    for name in ("create_sweep_index", "create_history_key_index", "drop_history_at_index",
                 "create_terminal_index", "create_history_function", "create_history_on_claim",
                 "create_history_on_transition", "create_slots_index", "create_live_index",
                 "create_dead_index", "create_waiters_order_index",
                 "create_claim_limited_function", "create_effects_state_index"):
        conn.execute(queries[name])
    conn.execute(queries["set_schema_version"], {"version": str(SCHEMA_VERSION)})


def stored_schema_version(conn: Executes, queries: dict[str, str]) -> int | None:
    """The schema version the database records, or None when it has no lease tables yet
    (``conn``: an autocommit connection, or a transaction the caller may roll back)."""
    try:
        row = conn.execute(queries["get_schema_version"]).fetchone()
    except psycopg.errors.UndefinedTable:
        return None
    return None if row is None else int(row[0])


def schema_queries(schema: str) -> dict[str, str]:
    """The dialect's queries with ``{schema}`` replaced by ``schema``, quoted."""
    quoted = '"' + schema + '"'
    return {name: sql.replace("{schema}", quoted)
            for name, sql in load_queries("postgres").items()}


def carrying_claim(finish: str, claim: str) -> str:
    """One statement from the ``finish`` and ``claim`` queries (both ``WITH clock AS (...)``
    and one write): the finish's UPDATE, its fencing parameters renamed ``finished_*``, and the
    claim's INSERT as data-modifying CTEs over the one clock, answering one row: ``finished``
    (1 when the finish was accepted) and the claim's columns (NULL when it was refused).
    Made from the two queries themselves, so each keeps its rule as written once."""
    finish, claim = _statement(finish), _statement(claim)
    update_at, insert_at = finish.find("\nUPDATE "), claim.find("\nINSERT INTO ")
    if not finish.startswith("WITH clock AS") or not claim.startswith("WITH clock AS") \
            or update_at < 0 or insert_at < 0:
        raise ConfigError("postgres.sql: the finish and claim queries must each be "
                          "'WITH clock AS (...)' and one UPDATE / INSERT")
    update = finish[update_at + 1:]
    for name in ("key", "owner", "token"):
        update = update.replace(f"%({name})s", f"%(finished_{name})s")
    return (f"{claim[:insert_at].rstrip()},\nfinished AS (\n{update}\n),\n"
            f"claimed AS (\n{claim[insert_at + 1:]}\n)\n"
            "SELECT (SELECT count(*) FROM finished) AS finished, claimed.*\n"
            "FROM (SELECT 1) AS one LEFT JOIN claimed ON true")


def _statement(sql: str) -> str:
    """``sql`` without the comment lines that lead it."""
    lines = sql.splitlines()
    while lines and lines[0].lstrip().startswith("--"):
        lines.pop(0)
    return "\n".join(lines)


@functools.cache
def _libpq_options() -> frozenset[str]:
    """The connection parameters the libpq in use knows (a newer libpq knows more)."""
    return frozenset(option.keyword.decode() for option in psycopg.pq.Conninfo.get_defaults())
