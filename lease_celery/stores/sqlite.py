"""The embedded default store: one SQLite file shared by the worker processes of one host.

Every mutation runs in its own ``BEGIN IMMEDIATE`` transaction, and the clock is sampled only
after that transaction holds the write lock, so time spent waiting for the lock never counts
against a lease. ``SQLITE_BUSY`` is retried with full-jitter backoff up to ``busy_timeout``
seconds, then surfaces as ``StoreBusy``. Never put the file on a network file system: SQLite's
locking is not reliable there, and with it goes every guarantee this store makes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar
from urllib.parse import unquote, urlsplit

from ..checks import (
    cancel_reason,
    check_delay,
    check_key,
    check_limit,
    check_owner,
    check_ttl,
    decode_result,
    decode_task,
    encode_result,
    encode_task,
)
from ..errors import ConfigError, LeaseLost, StoreBusy, StoreError
from ..models import (
    EffectState,
    HistoryEntry,
    Lease,
    LeaseRecord,
    LeaseState,
    Receipt,
    StoreStats,
)
from .base import (
    DEFAULT_SWEEP_GRACE,
    PURGE_BATCH,
    Clock,
    Store,
    fence_params,
    lease_not_current,
    lease_params,
    settle_deadline_offset,
)
from .queries import load_queries
from .urls import number_option, url_options

__all__ = ["SQLiteStore"]

SCHEMA_VERSION = 5
_T = TypeVar("_T")
_SQLITE_BUSY, _SQLITE_LOCKED = 5, 6  # primary result codes (the module constants need 3.11)
_Q = load_queries("sqlite")
# Connections inherited through fork() must never be used or closed by the child (SQLite's
# locks are per process); they are parked here so garbage collection does not close them.
_INHERITED: list[sqlite3.Connection] = []


def _is_busy(exc: sqlite3.OperationalError) -> bool:
    code = getattr(exc, "sqlite_errorcode", None)
    if code is not None:
        return code & 0xFF in (_SQLITE_BUSY, _SQLITE_LOCKED)
    return "locked" in str(exc) or "busy" in str(exc)


class SQLiteStore(Store):
    """Lease store on a local SQLite file (``sqlite:///path``) or in memory (``sqlite://``).

    URL options: ``?busy_timeout=SECONDS`` (default 10) bounds how long one operation waits for
    other writers before raising ``StoreBusy``. ``?synchronous=full`` (default) makes every
    commit durable across a power loss (one fsync per claim and per finish), so a token never
    goes backwards; ``?synchronous=normal`` (SQLite's recommended mode for WAL) survives any
    process crash, SIGKILL included, but an OS crash or power loss may roll back the last
    commits, and with them the last tokens handed out.
    """

    def __init__(self, url: str, *, clock: Clock | None = None) -> None:
        self.url = url
        self.path, self.busy_timeout, self.synchronous = self._parse(url)
        self._clock = clock
        self._lock = threading.RLock()
        self._conn: sqlite3.Connection | None = None
        self._pid = 0

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
        pid = os.getpid()
        if self._conn is not None and self._pid == pid:
            return self._conn
        if self._conn is not None:
            _INHERITED.append(self._conn)  # made before fork(): belongs to the parent
        self._conn = None
        try:
            conn = sqlite3.connect(self.path, timeout=0, isolation_level=None,
                                   check_same_thread=False)
        except sqlite3.Error as exc:
            raise StoreError(f"cannot open sqlite store {self.path!r}: {exc}") from exc
        self._conn, self._pid = conn, pid
        try:
            self._retry_busy(lambda: self._setup(conn))
        except BaseException:
            self._conn = None
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
        conn.execute("BEGIN IMMEDIATE")
        try:
            conn.execute(_Q["create_leases"])
            conn.execute(_Q["create_retired"])
            conn.execute(_Q["create_effects"])
            conn.execute(_Q["create_fence"])
            conn.execute(_Q["init_fence"])
            conn.execute(_Q["create_history"])
            conn.execute(_Q["create_history_key_index"])
            conn.execute(_Q["drop_history_at_index"])
            conn.execute(_Q["create_history_on_claim"])
            conn.execute(_Q["create_history_on_transition"])
            conn.execute(_Q["create_meta"])
            row = conn.execute(_Q["get_schema_version"]).fetchone()
            if row is not None and int(row[0]) > SCHEMA_VERSION:
                raise StoreError(f"sqlite store {self.path!r} has schema version {row[0]}, newer"
                                 f" than this lease_celery understands ({SCHEMA_VERSION})")
            if row is not None and int(row[0]) < SCHEMA_VERSION:
                self._migrate(conn, from_version=int(row[0]))
            conn.execute(_Q["create_sweep_index"])
            conn.execute(_Q["create_terminal_index"])
            if row is None or int(row[0]) != SCHEMA_VERSION:
                conn.execute(_Q["set_schema_version"], {"version": str(SCHEMA_VERSION)})
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise

    @staticmethod
    def _migrate(conn: sqlite3.Connection, *, from_version: int) -> None:
        """In the setup's transaction: schema 1 -> 2, the settle phase and the sweeper's own
        index; 2 -> 3, checkpoints and cancellation (new columns, nothing rewritten)."""
        columns = {name for (name,) in conn.execute(_Q["table_columns"])}
        for column in ("settling", "sweep_at", "swept_by", "checkpoint", "cancel"):
            if column not in columns:
                conn.execute(_Q[f"migrate_{column}"])
        if from_version < 2:
            conn.execute(_Q["migrate_fill_sweep_at"])

    def close(self) -> None:
        with self._lock:
            conn, self._conn = self._conn, None
            if conn is not None and self._pid == os.getpid():
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

    # -- contract ---------------------------------------------------------------------------

    def claim(self, key: str, *, owner: str, ttl: float,
              task: Mapping[str, Any] | None = None) -> Lease | None:
        key, owner, ttl = check_key(key), check_owner(owner), check_ttl(ttl)
        task_json = encode_task(task)

        def body(conn: sqlite3.Connection, now: float) -> Lease | None:
            row = conn.execute(_Q["claim"], {"key": key, "owner": owner, "now": now,
                                             "expires_at": now + ttl, "task": task_json}
                               ).fetchone()
            if row is None:
                return None
            conn.execute(_Q["bump_fence"])  # the fence the row took is now spent
            return Lease(key, owner, int(row[0]), float(row[1]), int(row[2]),
                         attempts=int(row[3]), takeovers=int(row[4]), cancel=row[5])

        return self._write(body)

    def renew(self, lease: Lease, *, ttl: float) -> Lease | None:
        return self.renew_many([lease], ttl=ttl)[0]

    def renew_many(self, leases: Sequence[Lease], *, ttl: float) -> list[Lease | None]:
        ttl = check_ttl(ttl)
        if not leases:
            return []

        def body(conn: sqlite3.Connection, now: float) -> list[Lease | None]:
            renewed: list[Lease | None] = []
            for lease in leases:
                row = conn.execute(_Q["renew"], {**fence_params(lease), "now": now,
                                                 "expires_at": now + ttl}).fetchone()
                renewed.append(None if row is None else dataclasses.replace(
                    lease, expires_at=float(row[0]), cancel=row[1]))
            return renewed

        return self._write(body)

    def finish(self, lease: Lease, result: Any = None, *,
               settle_within: float | None = None) -> bool:
        encoded = encode_result(result)  # before the transaction: a bad result writes nothing
        within = settle_deadline_offset(settle_within)
        return self._write(lambda conn, now: conn.execute(_Q["finish"], {
            **fence_params(lease), "now": now, "result": encoded,
            "settle_deadline": None if within is None else now + within}).rowcount == 1)

    def checkpoint(self, lease: Lease, data: str) -> bool:
        params = {**fence_params(lease), "checkpoint": str(data)}
        return self._write(lambda conn, now: conn.execute(
            _Q["checkpoint"], {**params, "now": now}).rowcount == 1)

    def cancel(self, key: str, *, reason: str) -> bool:
        params = {"key": check_key(key), "reason": cancel_reason(reason)}

        def body(conn: sqlite3.Connection, now: float) -> bool:
            if conn.execute(_Q["cancel_held"], {**params, "now": now}).rowcount == 1:
                return True
            return conn.execute(_Q["cancel_idle"], {**params, "now": now}).rowcount == 1

        return self._write(body)

    def settle_many(self, leases: Sequence[Lease]) -> list[bool]:
        if not leases:
            return []
        return self._write(lambda conn, now: [conn.execute(
            _Q["settle"], {**fence_params(lease), "now": now}).rowcount == 1
            for lease in leases])

    def claim_settlement(self, key: str, *, owner: str, ttl: float) -> Lease | None:
        key, owner, ttl = check_key(key), check_owner(owner), check_ttl(ttl)

        def body(conn: sqlite3.Connection, now: float) -> Lease | None:
            row = conn.execute(_Q["claim_settlement"], {
                "key": key, "owner": owner, "now": now, "expires_at": now + ttl}).fetchone()
            return None if row is None else Lease(
                key, owner, int(row[0]), float(row[1]), int(row[2]), attempts=int(row[3]),
                takeovers=int(row[4]))

        return self._write(body)

    def release(self, lease: Lease, *, delay: float = 0.0, reason: str | None = None) -> bool:
        delay = check_delay(delay)
        return self._write(lambda conn, now: conn.execute(_Q["release"], {
            **fence_params(lease), "now": now, "reason": reason,
            "not_before": now + delay if delay else None}).rowcount == 1)

    def kill(self, lease: Lease, *, reason: str, settle_within: float | None = None) -> bool:
        within = settle_deadline_offset(settle_within)
        return self._write(lambda conn, now: conn.execute(_Q["kill"], {
            **fence_params(lease), "now": now, "reason": reason,
            "settle_deadline": None if within is None else now + within}).rowcount == 1)

    # -- operator actions -------------------------------------------------------------------

    def force_release(self, key: str, *, reason: str) -> bool:
        key = check_key(key)
        return self._write(lambda conn, now: conn.execute(
            _Q["force_release"], {"key": key, "now": now, "reason": reason}).rowcount == 1)

    def requeue(self, key: str, *, reason: str) -> LeaseRecord | None:
        key = check_key(key)
        requeued = self._write(lambda conn, now: conn.execute(
            _Q["requeue"], {"key": key, "now": now, "reason": reason}).fetchone() is not None)
        return self.get(key) if requeued else None

    def find(self, *, state: LeaseState | None = None, prefix: str | None = None,
             owner: str | None = None, limit: int = 100) -> list[LeaseRecord]:
        params = {"state": None if state is None else LeaseState(state).value,
                  "prefix": prefix, "owner": owner, "limit": check_limit(limit)}
        rows = self._read(lambda conn: conn.execute(_Q["list"], params).fetchall())
        return [self._record(row) for row in rows]

    def stats(self) -> StoreStats:
        rows = self._read(lambda conn: conn.execute(_Q["stats"], {"now": self._now()}).fetchall())
        return StoreStats(counts={state: int(n) for state, n, _ in rows},
                          expired=sum(int(expired or 0) for _, _, expired in rows))

    def purge_older_than(self, seconds: float, *, limit: int | None = None) -> int:
        seconds = check_delay(seconds)
        batch = PURGE_BATCH if limit is None else check_limit(limit)

        def body(conn: sqlite3.Connection, now: float) -> int:
            params = {"cutoff": now - seconds, "limit": batch}
            conn.execute(_Q["retire_old"], params)
            return int(conn.execute(_Q["purge_old"], params).rowcount)

        # Small transactions: the write lock is never held for a whole table's worth.
        purged = self._write(body)
        total = purged
        while limit is None and purged == batch:
            purged = self._write(body)
            total += purged
        return total

    def sweep_expired(self, *, limit: int = 100,
                      grace: float = DEFAULT_SWEEP_GRACE) -> list[LeaseRecord]:
        params = {"limit": check_limit(limit), "grace": check_delay(grace, name="grace"),
                  "nonce": uuid.uuid4().hex}

        def body(conn: sqlite3.Connection, now: float) -> list[str]:
            keys = [k for (k,) in conn.execute(_Q["sweep_candidates"], {**params, "now": now})]
            return [k for k in keys if conn.execute(
                _Q["sweep_mark"], {**params, "key": k, "now": now}).fetchone()]

        return [record for key in self._write(body) if (record := self.get(key)) is not None]

    def record_history_many(self, entries: Sequence[HistoryEntry]) -> None:
        rows = [(e.key, e.at, e.event, e.owner, e.token, e.fence, e.detail) for e in entries]
        if rows:
            self._write(lambda conn, now: conn.executemany(_Q["history_insert"], rows))

    def history(self, key: str, *, limit: int = 100) -> list[HistoryEntry]:
        params = {"key": check_key(key), "limit": check_limit(limit)}
        rows = self._read(lambda conn: conn.execute(_Q["history_of"], params).fetchall())
        return [HistoryEntry(*row) for row in rows]

    def recent_history(self, *, events: Sequence[str] | None = None,
                       limit: int = 100) -> list[HistoryEntry]:
        params = {"events": None if events is None else json.dumps(list(events)),
                  "limit": check_limit(limit)}
        rows = self._read(lambda conn: conn.execute(_Q["history_recent"], params).fetchall())
        return [HistoryEntry(*row) for row in rows]

    def prune_history(self, seconds: float, *, limit: int = PURGE_BATCH * 10) -> int:
        seconds = check_delay(seconds)
        # Entries carry the clock of the process that saw them: so does the cutoff.
        cutoff = time.time() - seconds
        return self._write(lambda conn, now: int(conn.execute(_Q["history_prune"], {
            "cutoff": cutoff, "limit": check_limit(limit)}).rowcount))

    def sweep_unmark(self, key: str, token: int) -> bool:
        params = {"key": check_key(key), "token": token}
        return self._write(lambda conn, now: conn.execute(
            _Q["sweep_unmark"], params).rowcount == 1)

    def _read(self, query: Callable[[sqlite3.Connection], _T]) -> _T:
        with self._lock:
            return self._retry_busy(lambda: query(self._connection()))

    @staticmethod
    def _record(row: Sequence[Any]) -> LeaseRecord:
        return LeaseRecord.from_row(row, result=decode_result(row[6]),
                                    task=decode_task(row[12]),
                                    checkpoint=decode_result(row[14]))

    def purge(self, key: str) -> bool:
        key = check_key(key)

        def body(conn: sqlite3.Connection, now: float) -> bool:
            conn.execute(_Q["retire"], {"key": key, "now": now})
            return conn.execute(_Q["purge"], {"key": key, "now": now}).rowcount == 1

        return self._write(body)

    def get(self, key: str) -> LeaseRecord | None:
        key = check_key(key)
        row = self._read(lambda conn: conn.execute(_Q["get"], {"key": key}).fetchone())
        return None if row is None else self._record(row)

    def now(self) -> float:
        return self._now()

    # -- effect receipts --------------------------------------------------------------------

    def effect_insert(self, key: str, fingerprint: str, lease: Lease | None) -> bool:
        params = {"key": check_key(key), "fingerprint": fingerprint, **lease_params(lease)}

        def body(conn: sqlite3.Connection, now: float) -> bool:
            self._require_current(conn, lease, now)
            return conn.execute(_Q["effect_insert"], {**params, "now": now}).rowcount == 1

        return self._write(body)

    def effect_get(self, key: str) -> Receipt | None:
        key = check_key(key)
        row = self._read(lambda conn: conn.execute(_Q["effect_get"], {"key": key}).fetchone())
        return None if row is None else Receipt.from_row(row, result=decode_result(row[8]))

    def effect_find(self, *, state: EffectState | None = None,
                    limit: int = 100) -> list[Receipt]:
        params = {"state": None if state is None else EffectState(state).value,
                  "limit": check_limit(limit)}
        rows = self._read(lambda conn: conn.execute(_Q["effect_find"], params).fetchall())
        return [Receipt.from_row(row, result=decode_result(row[8])) for row in rows]

    def effect_update(self, key: str, *, version: int, state: EffectState,
                      result: str | None) -> bool:
        params = {"key": key, "version": version, "state": state.value, "result": result}
        return self._write(lambda conn, now: conn.execute(
            _Q["effect_update"], {**params, "now": now}).rowcount == 1)

    def effect_restart(self, key: str, *, version: int, lease: Lease | None) -> bool:
        params = {"key": key, "version": version, **lease_params(lease)}

        def body(conn: sqlite3.Connection, now: float) -> bool:
            self._require_current(conn, lease, now)
            return conn.execute(_Q["effect_restart"], {**params, "now": now}).rowcount == 1

        return self._write(body)

    @staticmethod
    def _require_current(conn: sqlite3.Connection, lease: Lease | None, now: float) -> None:
        """Inside the write transaction: the effect's lease (if any) must be current."""
        if lease is not None and conn.execute(
                _Q["check_current"], {**fence_params(lease), "now": now}).fetchone() is None:
            raise lease_not_current(lease, "when the effect was to start")

    def effect_delete(self, key: str, *, version: int) -> bool:
        return self._write(lambda conn, now: conn.execute(
            _Q["effect_delete"], {"key": key, "version": version}).rowcount == 1)

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
        params = fence_params(lease)
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
            raise LeaseLost(f"lease {lease.key!r} (owner {lease.owner}, token {lease.token}) "
                            f"is not current {when}; nothing was committed")
