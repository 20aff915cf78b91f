"""The embedded default store: one SQLite file shared by the worker processes of one host.

Every mutation runs in its own ``BEGIN IMMEDIATE`` transaction, and the clock is sampled only
after that transaction holds the write lock, so time spent waiting for the lock never counts
against a lease. ``SQLITE_BUSY`` is retried with full-jitter backoff up to ``busy_timeout``
seconds, then surfaces as ``StoreBusy``. Never put the file on a network file system: SQLite's
locking is not reliable there, and with it goes every guarantee this store makes.
"""

from __future__ import annotations

import json
import os
import random
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar
from urllib.parse import unquote, urlsplit

from ..app_connections import AppConnection, CheckedConnections
from ..checks import check_ttl
from ..errors import ConfigError, StoreBusy, StoreError
from ..limits import Rate
from ..models import EffectState, Finding, HistoryEntry, Lease, LeaseState
from .base import (
    Clock,
    Row,
    Store,
    check_lease,
    effective_interval,
    effective_limit,
    fence_params,
    group_verdict,
    lease_not_current,
    lease_params,
)
from .queries import load_queries
from .sql_glue import (
    SCHEMA_VERSION,
    PerProcess,
    check_schema_version,
    effect_find_query,
    find_queries,
    find_query,
    grouped,
    purge_in_batches,
)
from .sqlite_diagnosis import path_findings
from .urls import number_option, url_options

__all__ = ["SQLiteStore", "create_schema", "stored_schema_version"]

_T = TypeVar("_T")
_SQLITE_BUSY, _SQLITE_LOCKED = 5, 6  # primary result codes (the module constants need 3.11)
_Q = {**load_queries("sqlite")}
_Q.update(find_queries(_Q))


def _row(row: sqlite3.Row | None) -> Row | None:
    return None if row is None else dict(row)


def _is_busy(exc: sqlite3.OperationalError) -> bool:
    code = getattr(exc, "sqlite_errorcode", None)
    if code is not None:
        return code & 0xFF in (_SQLITE_BUSY, _SQLITE_LOCKED)
    return "locked" in str(exc) or "busy" in str(exc)


def create_schema(conn: sqlite3.Connection, where: str) -> None:
    """The store's schema made, or migrated to ``SCHEMA_VERSION``, in the caller's write
    transaction: the store's first connection runs it, and so do the Django app's migrations
    (``lease_celery.contrib.django``), so there is one definition of the schema. ``where``
    names the file in messages."""
    for name in ("create_leases", "create_retired", "create_effects", "create_fence",
                 "init_fence", "create_history", "create_history_key_index",
                 "drop_history_at_index", "create_history_on_claim",
                 "create_history_on_transition", "create_meta", "create_limits",
                 "create_waiters", "create_waiters_order_index"):
        conn.execute(_Q[name])
    row = conn.execute(_Q["get_schema_version"]).fetchone()
    check_schema_version(None if row is None else int(row[0]), where)
    if row is not None and int(row[0]) < SCHEMA_VERSION:
        _migrate(conn, from_version=int(row[0]))
    for name in ("create_sweep_index", "create_terminal_index", "create_slots_index",
                 "create_live_index", "create_dead_index", "create_effects_state_index"):
        conn.execute(_Q[name])
    if row is None or int(row[0]) != SCHEMA_VERSION:
        conn.execute(_Q["set_schema_version"], {"version": str(SCHEMA_VERSION)})


def stored_schema_version(conn: sqlite3.Connection) -> int | None:
    """The schema version the file records, or None when it has no lease tables yet."""
    try:
        row = conn.execute(_Q["get_schema_version"]).fetchone()
    except sqlite3.OperationalError as exc:
        if "no such table" in str(exc):
            return None
        raise
    return None if row is None else int(row[0])


def _migrate(conn: sqlite3.Connection, *, from_version: int) -> None:
    """From any older schema (``sql_glue.SCHEMA_VERSION`` says what each added): the columns
    it lacks; schema 1's rows get their sweep time."""
    columns = {name for (name,) in conn.execute(_Q["table_columns"])}
    for column in ("settling", "sweep_at", "swept_by", "checkpoint", "cancel", "grp",
                   "slot"):
        if column not in columns:
            conn.execute(_Q[f"migrate_{column}"])
    if from_version < 2:
        conn.execute(_Q["migrate_fill_sweep_at"])
    if from_version < 7:
        conn.execute(_Q["drop_terminal_index"])  # made again below, with the state


class SQLiteStore(Store):
    """Lease store on a local SQLite file (``sqlite:///path``) or in memory (``sqlite://``).

    URL options: ``?busy_timeout=SECONDS`` (default 10) bounds how long one operation waits for
    other writers before raising ``StoreBusy``. ``?synchronous=full`` (default) makes every
    commit durable across a power loss (one fsync per claim and per finish), so a token never
    goes backwards; ``?synchronous=normal`` (SQLite's recommended mode for WAL) survives any
    process crash, SIGKILL included, but an OS crash or power loss may roll back the last
    commits, and with them the last tokens handed out.
    """

    carries_finish = True  # finish_and_claim: one transaction, one fsync

    def __init__(self, url: str, *, clock: Clock | None = None) -> None:
        self.url = url
        self.path, self.busy_timeout, self.synchronous = self._parse(url)
        self._clock = clock
        self._app_files = CheckedConnections()
        self._lock = threading.RLock()
        self._conn: PerProcess[sqlite3.Connection] = PerProcess()

    @classmethod
    def check_url(cls, url: str) -> None:
        cls._parse(url, check_paths=False)

    @staticmethod
    def _parse(url: str, *, check_paths: bool = True) -> tuple[str, float, str]:
        parts = urlsplit(url)
        if not url.startswith(f"{parts.scheme}://"):
            raise ConfigError(f"sqlite URL {url!r} must start with sqlite:// (sqlite:///relative"
                              " or sqlite:////absolute/path)")
        if parts.netloc:
            raise ConfigError(
                f"sqlite URL {url!r} names a host ({parts.netloc!r}); use sqlite:///relative/path"
                " or sqlite:////absolute/path (SQLite files must be local to this machine)"
            )
        options = url_options("sqlite", parts, url, ("busy_timeout", "synchronous"))
        busy_timeout = check_ttl(
            number_option(url, "busy_timeout", options.pop("busy_timeout", None), 10.0),
            name="sqlite busy_timeout")
        synchronous = options.pop("synchronous", "full").lower()
        if synchronous not in ("full", "normal"):
            raise ConfigError(f"sqlite URL option synchronous={synchronous!r} in {url!r} must "
                              "be full or normal")
        # sqlite:///rel -> path "/rel" -> "rel"; sqlite:////abs -> "//abs" -> "/abs".
        path = unquote(parts.path)[1:] if parts.path else ""
        if not path or path == ":memory:":
            return ":memory:", busy_timeout, synchronous
        if not check_paths:
            return path, busy_timeout, synchronous
        directory = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(directory):
            raise ConfigError(f"sqlite store directory {directory!r} does not exist (from {url!r})")
        if os.path.isdir(path):
            raise ConfigError(f"sqlite store path {path!r} is a directory, not a file")
        return os.path.abspath(path), busy_timeout, synchronous

    # -- connection -------------------------------------------------------------------------

    def _connection(self) -> sqlite3.Connection:
        conn = self._conn.get()
        if conn is not None:
            return conn
        try:
            conn = sqlite3.connect(self.path, timeout=0, isolation_level=None,
                                   check_same_thread=False)
            conn.row_factory = sqlite3.Row  # rows are read by column name (stores.rows)
        except sqlite3.Error as exc:
            raise StoreError(f"cannot open sqlite store {self.path!r}: {exc}") from exc
        self._conn.set(conn)
        try:
            self._retry_busy(lambda: self._setup(conn))
        except BaseException:
            self._conn.set(None)
            conn.close()
            raise
        return conn

    def _setup(self, conn: sqlite3.Connection) -> None:
        if self.path != ":memory:":
            mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            if str(mode).lower() != "wal":
                raise StoreError(f"sqlite store {self.path!r} could not switch to WAL ({mode})")
        # FULL (the default): a committed claim survives power loss, so a token can never go
        # backwards. NORMAL: no fsync per commit; only an OS crash can roll commits back.
        conn.execute(f"PRAGMA synchronous={self.synchronous.upper()}")
        if self._schema_current(conn):
            # Written last by the setup below: everything is there. No write lock wanted, so
            # that a process whose app transaction holds the file's (a store in the app's own
            # database) can still open its store.
            return
        conn.execute("BEGIN IMMEDIATE")
        try:
            self._create_schema(conn)
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise

    def _create_schema(self, conn: sqlite3.Connection) -> None:
        """Inside the setup's write transaction: the schema made or migrated."""
        create_schema(conn, f"sqlite store {self.path!r}")

    @staticmethod
    def _schema_current(conn: sqlite3.Connection) -> bool:
        try:
            row = conn.execute(_Q["get_schema_version"]).fetchone()
        except sqlite3.OperationalError:  # no meta table yet: a new file
            return False
        return row is not None and int(row[0]) == SCHEMA_VERSION

    def close(self) -> None:
        with self._lock:
            conn = self._conn.take()
            if conn is not None:
                conn.close()

    # -- transactions -----------------------------------------------------------------------

    def _retry_busy(self, operation: Callable[[], _T]) -> _T:
        # The wait is measured by adding up the sleeps, not by reading a clock: under a frozen
        # clock (freezegun in a user's tests) a clock-based deadline would never arrive.
        waited = 0.0
        attempt = 0
        while True:
            try:
                return operation()
            except sqlite3.OperationalError as exc:
                if not _is_busy(exc):
                    raise StoreError(f"sqlite store {self.path!r}: {exc}") from exc
                remaining = self.busy_timeout - waited
                if remaining <= 0:
                    raise StoreBusy(f"sqlite store {self.path!r} stayed locked for more than "
                                    f"{self.busy_timeout:g}s ({exc})") from exc
                # Full jitter: spreads 16 contending processes instead of waking them together.
                # The first pauses are tens of microseconds: a lease write holds the lock for
                # about that long, and sleeping milliseconds on every collision cost more
                # than the write itself. The growth bounds the count of attempts; its cap is
                # low (5 ms) because a writer sleeping long loses the lock to one that retries
                # sooner, again and again (claims waited 100+ ms behind 3 ms sweeps).
                attempt += 1
                # (The exponent stops growing at the cap: a writer stalled for seconds makes
                # thousands of attempts, and 2 ** 1024 does not fit a float.)
                grown = 0.0001 * 2 ** min(attempt, 6)
                pause = min(remaining, random.uniform(0.00002, min(0.005, grown)))
                time.sleep(pause)
                waited += pause
            except sqlite3.Error as exc:
                raise StoreError(f"sqlite store {self.path!r}: {exc}") from exc

    def _write(self, body: Callable[[sqlite3.Connection, float], _T]) -> _T:
        """Run ``body(conn, now)`` in one BEGIN IMMEDIATE transaction, ``now`` read in it."""
        def attempt() -> _T:
            conn = self._begin()
            try:
                result = body(conn, self._now())
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise
            return result

        with self._lock:
            return self._retry_busy(attempt)

    # -- primitives (Store checks and decodes; these only talk to the file) -----------------

    def _claim(self, key: str, owner: str, ttl: float, task: str | None) -> Row | None:
        def body(conn: sqlite3.Connection, now: float) -> Row | None:
            return self._claim_in(conn, now, key, owner, ttl, task)

        return self._write(body)

    def _finish_and_claim(self, finished: Lease, result: str, key: str, owner: str,
                          ttl: float, task: str | None) -> tuple[bool, Row | None]:
        def body(conn: sqlite3.Connection, now: float) -> tuple[bool, Row | None]:
            return (self._finish_in(conn, now, finished, result, None),
                    self._claim_in(conn, now, key, owner, ttl, task))

        return self._write(body)  # one transaction: one commit, one fsync

    @staticmethod
    def _claim_in(conn: sqlite3.Connection, now: float, key: str, owner: str, ttl: float,
                  task: str | None, group: str | None = None,
                  slot: int | None = None) -> Row | None:
        row = conn.execute(_Q["claim"], {"key": key, "owner": owner, "now": now,
                                         "expires_at": now + ttl, "task": task, "grp": group,
                                         "slot": slot}).fetchone()
        if row is not None:
            conn.execute(_Q["bump_fence"])  # the fence the row took is now spent
        return _row(row)

    def _claim_limited(self, key: str, owner: str, ttl: float, task: str | None, group: str,
                       limit: int | None, rate: Rate | None) -> Row | None:
        params: dict[str, Any] = {
            "grp": group, "key": key, "task": task, "limit": limit,
            "rate": None if rate is None else rate.text,
            "interval": None if rate is None else rate.interval}

        def body(conn: sqlite3.Connection, now: float) -> Row | None:
            # BEGIN IMMEDIATE holds the only write lock: the group's claims are serialised.
            bound = {**params, "now": now}
            # (Raw columns: SQLite 3.40 answers NULL for a CASE over them in this RETURNING.)
            task_limit, set_limit, task_interval, set_interval, tat, slots = conn.execute(
                _Q["limit_upsert"], bound).fetchone()
            lim = effective_limit(task_limit, set_limit)
            interval = effective_interval(task_interval, set_interval)
            if conn.execute(_Q["key_held"], bound).fetchone() is not None:
                conn.execute(_Q["waiter_drop"], bound)
                return None
            running = conn.execute(_Q["group_running"], bound).fetchone()[0]
            ahead = conn.execute(_Q["waiters_ahead"], bound).fetchone()[0]
            verdict = group_verdict(limit=lim, interval=interval, running=running,
                                    ahead=ahead, tat=tat, now=now)
            if verdict == "limit":
                if task is not None and conn.execute(_Q["waiter_park"], bound).rowcount:
                    conn.execute(_Q["group_seq_bump"], bound)
                waiting = conn.execute(_Q["waiter_count"], bound).fetchone()[0]
                return {"verdict": verdict, "running": running, "lim": lim,
                        "waiting": waiting}
            if verdict == "rate":
                return {"verdict": verdict, "running": running, "lim": lim, "retry_at": tat}
            row = self._claim_in(conn, now, key, owner, ttl, task, group, slots + 1)
            if row is None:  # cannot happen under the write lock; refused as the key's
                return None
            conn.execute(_Q["group_granted"], {**bound, "interval": interval})
            conn.execute(_Q["waiter_drop"], bound)
            return {**row, "verdict": verdict}

        return self._write(body)

    def _hand_on(self, group: str | None, grace: float, limit: int) -> list[Row]:
        # Read first: the sweeper asks on every sweep and a limited task at every finish, and
        # a group without waiters (most) should not take the file's only write lock for it.
        # (A waiter parks in the transaction that saw no free slot, so one parked before this
        # read began is seen, and one parked after it saw the slot this caller freed.)
        query, params = (("groups_waiting", {"limit": 1}) if group is None else
                         ("waiters_first", {"grp": group, "limit": 1}))
        if not self._read(lambda conn: conn.execute(_Q[query], params).fetchone()):
            return []

        def body(conn: sqlite3.Connection, now: float) -> list[Row]:
            groups = ([group] if group is not None else
                      [g for (g,) in conn.execute(_Q["groups_waiting"], {"limit": limit})])
            handed: list[Row] = []
            for grp in groups:
                found = conn.execute(_Q["group_limit"], {"grp": grp}).fetchone()
                lim = None if found is None else effective_limit(*found)
                free = limit - len(handed)
                if lim is not None:
                    running = conn.execute(_Q["group_running"], {
                        "grp": grp, "now": now, "key": ""}).fetchone()[0]
                    free = min(free, lim - running)
                if free <= 0:
                    continue
                for row in conn.execute(_Q["waiters_first"], {"grp": grp, "limit": free}
                                        ).fetchall():
                    if row["handed_at"] is None or row["handed_at"] <= now - grace:
                        conn.execute(_Q["waiter_handed"], {"grp": grp, "key": row["key"],
                                                           "now": now})
                        handed.append(dict(row))
            return handed

        return self._write(body)

    def _set_limit(self, group: str, changes: dict[str, Any]) -> None:
        params = {"grp": group, "set_limit": changes.get("set_limit"),
                  "set_rate": changes.get("set_rate"),
                  "set_interval": changes.get("set_interval"),
                  "change_limit": "set_limit" in changes, "change_rate": "set_rate" in changes}
        self._write(lambda conn, now: conn.execute(_Q["limit_set"], {**params, "now": now}))

    def _limits(self, group: str | None, limit: int) -> list[Row]:
        return [dict(row) for row in self._read(lambda conn: conn.execute(
            _Q["limits_list"], {"grp": group, "limit": limit, "now": self._now()}).fetchall())]

    def _record_published(self, key: str, task: str, countdown: float) -> bool:
        return self._write(lambda conn, now: conn.execute(_Q["record_published"], {
            "key": key, "task": task, "now": now, "countdown": countdown}).rowcount == 1)

    def _renew_many(self, leases: Sequence[Lease], ttl: float) -> list[Row | None]:
        return self._write(lambda conn, now: [_row(conn.execute(_Q["renew"], {
            **fence_params(lease), "now": now, "expires_at": now + ttl}).fetchone())
            for lease in leases])

    def _finish(self, lease: Lease, result: str, settle_within: float | None) -> bool:
        return self._write(lambda conn, now: self._finish_in(conn, now, lease, result,
                                                             settle_within))

    @staticmethod
    def _finish_in(conn: sqlite3.Connection, now: float, lease: Lease, result: str,
                   settle_within: float | None) -> bool:
        return conn.execute(_Q["finish"], _finish_params(now, lease, result, settle_within)
                            ).rowcount == 1

    def _release(self, lease: Lease, delay: float, reason: str | None, task: str | None,
                 counted: bool) -> bool:
        return self._write(lambda conn, now: conn.execute(_Q["release"], {
            **fence_params(lease), "now": now, "reason": reason, "task": task,
            "given_back": 0 if counted else 1,
            "not_before": now + delay if delay else None}).rowcount == 1)

    def _kill(self, lease: Lease, reason: str, settle_within: float | None,
              error: str | None) -> bool:
        return self._write(lambda conn, now: conn.execute(_Q["kill"], {
            **fence_params(lease), "now": now, "reason": reason, "error": error,
            "settle_deadline": None if settle_within is None else now + settle_within}
            ).rowcount == 1)

    def _checkpoint(self, lease: Lease, data: str) -> bool:
        return self._write(lambda conn, now: conn.execute(_Q["checkpoint"], {
            **fence_params(lease), "checkpoint": data, "now": now}).rowcount == 1)

    def _settle_many(self, leases: Sequence[Lease]) -> list[bool]:
        def settled(conn: sqlite3.Connection, lease: Lease, now: float) -> bool:
            params = {**fence_params(lease), "now": now}
            return (conn.execute(_Q["settle"], params).rowcount == 1
                    or conn.execute(_Q["settled_by_owner"], params).fetchone() is not None)

        return self._write(lambda conn, now: [settled(conn, lease, now) for lease in leases])

    def _claim_settlement(self, key: str, owner: str, ttl: float) -> Row | None:
        return self._write(lambda conn, now: _row(conn.execute(_Q["claim_settlement"], {
            "key": key, "owner": owner, "now": now, "expires_at": now + ttl}).fetchone()))

    def _cancel(self, key: str, reason: str) -> bool:
        def body(conn: sqlite3.Connection, now: float) -> bool:
            params = {"key": key, "reason": reason, "now": now}
            return (conn.execute(_Q["cancel_held"], params).rowcount == 1
                    or conn.execute(_Q["cancel_idle"], params).rowcount == 1)

        return self._write(body)

    def _force_release(self, key: str, reason: str) -> bool:
        return self._write(lambda conn, now: conn.execute(
            _Q["force_release"], {"key": key, "now": now, "reason": reason}).rowcount == 1)

    def _requeue(self, key: str, reason: str) -> bool:
        return self._write(lambda conn, now: conn.execute(
            _Q["requeue"], {"key": key, "now": now, "reason": reason}).fetchone() is not None)

    def _purge(self, key: str) -> bool:
        def body(conn: sqlite3.Connection, now: float) -> bool:
            conn.execute(_Q["retire"], {"key": key, "now": now})
            return conn.execute(_Q["purge"], {"key": key, "now": now}).rowcount == 1

        return self._write(body)

    def _purge_older_than(self, seconds: float, limit: int | None) -> int:
        def batch(size: int) -> int:
            def body(conn: sqlite3.Connection, now: float) -> int:
                params = {"cutoff": now - seconds, "limit": size}
                conn.execute(_Q["retire_old"], params)
                return int(conn.execute(_Q["purge_old"], params).rowcount)

            return self._write(body)

        # Small transactions: the write lock is never held for a whole table's worth.
        return purge_in_batches(batch, limit)

    def _get(self, key: str) -> Row | None:
        return _row(self._read(lambda conn: conn.execute(_Q["get"], {"key": key}).fetchone()))

    def _find(self, state: LeaseState | None, prefix: str | None, owner: str | None,
              limit: int) -> list[Row]:
        params = {"prefix": prefix, "owner": owner, "limit": limit}
        return [dict(row) for row in self._read(
            lambda conn: conn.execute(_Q[find_query(state)], params).fetchall())]

    def _stats(self) -> list[Row]:
        return [dict(row) for row in self._read(
            lambda conn: conn.execute(_Q["stats"], {"now": self._now()}).fetchall())]

    def _sweep_expired(self, limit: int, grace: float, nonce: str) -> list[str]:
        def body(conn: sqlite3.Connection, now: float) -> list[str]:
            params = {"limit": limit, "grace": grace, "nonce": nonce, "now": now}
            keys = [k for (k,) in conn.execute(_Q["sweep_candidates"], params)]
            return [k for k in keys
                    if conn.execute(_Q["sweep_mark"], {**params, "key": k}).fetchone()]

        return self._write(body)

    def _sweep_unmark(self, key: str, token: int) -> bool:
        return self._write(lambda conn, now: conn.execute(
            _Q["sweep_unmark"], {"key": key, "token": token}).rowcount == 1)

    def _record_history_many(self, entries: list[HistoryEntry]) -> None:
        rows = [(e.key, e.at, e.event, e.owner, e.token, e.fence, e.detail) for e in entries]
        self._write(lambda conn, now: conn.executemany(_Q["history_insert"], rows))

    def _history(self, key: str, limit: int) -> list[HistoryEntry]:
        rows = self._read(lambda conn: conn.execute(
            _Q["history_of"], {"key": key, "limit": limit}).fetchall())
        return [HistoryEntry(**dict(row)) for row in rows]

    def _history_many(self, keys: list[str], limit: int) -> dict[str, list[HistoryEntry]]:
        rows = self._read(lambda conn: conn.execute(
            _Q["history_many"], {"keys": json.dumps(keys), "limit": limit}).fetchall())
        return grouped(HistoryEntry(**dict(row)) for row in rows)

    def _recent_history(self, events: list[str] | None, limit: int) -> list[HistoryEntry]:
        params = {"events": None if events is None else json.dumps(events), "limit": limit}
        rows = self._read(lambda conn: conn.execute(_Q["history_recent"], params).fetchall())
        return [HistoryEntry(**dict(row)) for row in rows]

    def _prune_history(self, cutoff: float, limit: int) -> int:
        return self._write(lambda conn, now: int(conn.execute(_Q["history_prune"], {
            "cutoff": cutoff, "limit": limit}).rowcount))

    def _read(self, query: Callable[[sqlite3.Connection], _T]) -> _T:
        with self._lock:
            return self._retry_busy(lambda: query(self._connection()))

    def now(self) -> float:
        return self._now()

    def _diagnose(self) -> list[Finding]:
        # The path as the URL gives it: a relative one is each worker's working directory.
        return path_findings(self._parse(self.url, check_paths=False)[0])

    # -- effect receipts --------------------------------------------------------------------

    def _effect_insert(self, key: str, fingerprint: str, lease: Lease | None) -> bool | None:
        return self._effect_started("effect_insert", lease,
                                    {"key": key, "fingerprint": fingerprint})

    def _effect_restart(self, key: str, version: int, lease: Lease | None) -> bool | None:
        return self._effect_started("effect_restart", lease, {"key": key, "version": version})

    def _effect_started(self, query: str, lease: Lease | None,
                        params: dict[str, Any]) -> bool | None:
        """A receipt write started by ``lease``, in one transaction with the check that the
        lease is current: None (nothing written) if it is not."""
        def body(conn: sqlite3.Connection, now: float) -> bool | None:
            if not self._is_current(conn, lease, now):
                return None
            return conn.execute(_Q[query], {**params, **lease_params(lease), "now": now}
                                ).rowcount == 1

        return self._write(body)

    @staticmethod
    def _is_current(conn: sqlite3.Connection, lease: Lease | None, now: float) -> bool:
        """Inside the write transaction: is the effect's lease (if any) current?"""
        return lease is None or conn.execute(
            _Q["check_current"], {**fence_params(lease), "now": now}).fetchone() is not None

    def _effect_get(self, key: str) -> Row | None:
        return _row(self._read(
            lambda conn: conn.execute(_Q["effect_get"], {"key": key}).fetchone()))

    def _effect_find(self, state: EffectState | None, limit: int) -> list[Row]:
        params = {"state": None if state is None else state.value, "limit": limit}
        return [dict(row) for row in self._read(
            lambda conn: conn.execute(_Q[effect_find_query(state)], params).fetchall())]

    def _effect_update(self, key: str, version: int, state: EffectState,
                       result: str | None) -> bool:
        params = {"key": key, "version": version, "state": state.value, "result": result}
        return self._write(lambda conn, now: conn.execute(
            _Q["effect_update"], {**params, "now": now}).rowcount == 1)

    def _effect_delete(self, key: str, version: int) -> bool:
        return self._write(lambda conn, now: conn.execute(
            _Q["effect_delete"], {"key": key, "version": version}).rowcount == 1)

    # -- in the app's transaction (Store.lock_in, finish_in, record_published_in) ------------

    def _check_app_database(self, conn: AppConnection) -> None:
        if conn.dialect != "sqlite":
            raise ConfigError(f"sqlite store {self.path!r}: the app's connection is to a "
                              f"{conn.dialect} database, not this store's file")
        if conn in self._app_files:
            return
        files = {name: path for _, name, path in conn.execute("PRAGMA database_list", {})}
        there = files.get("main") or ":memory:"
        if self.path == ":memory:" or os.path.realpath(there) != os.path.realpath(self.path):
            raise ConfigError(f"sqlite store {self.path!r}: the app's connection is to "
                              f"{there!r}; the lease can only join a transaction on its own "
                              "file")
        if not conn.execute(_Q["leases_table_exists"], {}):
            # Made by the store's own connection, which would wait for this transaction's lock.
            raise ConfigError(f"sqlite store {self.path!r} has no tables in that file yet: "
                              "open the store once outside the transaction (a worker's start, "
                              "`celery leases doctor`, or open_store(url)) before writing in "
                              "the app's transaction")
        self._app_files.add(conn)

    def _app_lock(self, conn: AppConnection, lease: Lease) -> bool:
        return conn.changed(_Q["lock_current"], {**fence_params(lease), "now": self._now()}) == 1

    def _app_finish(self, conn: AppConnection, lease: Lease, result: str,
                    settle_within: float | None) -> bool:
        return conn.changed(_Q["finish"], _finish_params(self._now(), lease, result,
                                                         settle_within)) == 1

    def _app_record_published(self, conn: AppConnection, key: str, task: str,
                              countdown: float) -> bool:
        return conn.changed(_Q["record_published"], {
            "key": key, "task": task, "now": self._now(), "countdown": countdown}) == 1

    def _now(self) -> float:
        # time.time is looked up at each call, not bound at open, so freezegun (which patches
        # the module attribute) also governs a store opened before the freeze.
        return time.time() if self._clock is None else self._clock()

    @contextmanager
    def fenced(self, lease: Lease) -> Iterator[sqlite3.Connection]:
        """A write transaction on the store's file in which ``lease`` is verified current.

        Create your own tables in the same SQLite file and write them through the yielded
        connection: they commit only if the lease is still current at commit (checked again
        then); otherwise ``LeaseLost`` is raised and nothing is committed. The write lock is held
        throughout, so keep the block short.
        """
        params = fence_params(check_lease(lease))
        with self._lock:
            conn = self._retry_busy(self._begin)
            try:
                self._verify(conn, lease, params, "before the fenced writes")
                yield conn
                self._verify(conn, lease, params, "at commit")
                try:
                    conn.execute("COMMIT")
                except sqlite3.Error as exc:
                    raise StoreError(f"sqlite store {self.path!r}: {exc}") from exc
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise

    def _begin(self) -> sqlite3.Connection:
        conn = self._connection()
        conn.execute("BEGIN IMMEDIATE")
        return conn

    def _verify(self, conn: sqlite3.Connection, lease: Lease, params: dict[str, Any],
                when: str) -> None:
        try:
            row = conn.execute(_Q["check_current"], {**params, "now": self._now()}).fetchone()
        except sqlite3.Error as exc:
            raise StoreError(f"sqlite store {self.path!r}: {exc}") from exc
        if row is None:
            raise lease_not_current(lease, when, what="committed")


def _finish_params(now: float, lease: Lease, result: str,
                   settle_within: float | None) -> dict[str, Any]:
    """The finish's parameters, in the store's transaction or the app's."""
    return {**fence_params(lease), "now": now, "result": result,
            "settle_deadline": None if settle_within is None else now + settle_within}
