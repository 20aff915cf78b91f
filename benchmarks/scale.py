"""How the stores behave with 1,000,000 settled done rows compared with 1,000.

    python benchmarks/scale.py [--stores sqlite,postgres,redis] [--small 1000] [--big 1000000]
        [--cycles 500] [--gets 2000] [--window 2] [--no-ops] [--json] [--deadline 3600]

For each store, two isolated stores are filled with N settled ``done`` rows (N = ``--small``
and ``--big``): SQLite in a temporary directory (``lease_scale_<run>_*``), PostgreSQL in
schemas of the run's own (``scale_<run>_<size>``, dropped after), Redis database 14 under
prefixes of the run's own (``scale_<run>_<size>:``, deleted after). The fill writes the rows
directly (bulk SQL, a Redis pipeline) exactly as a LeasedTask's ``claim`` + ``finish`` would
have left a finished and settled key, after the library itself created the schema. Then a
sample is read back through ``store.get`` (done, settled, the key's first token, its result), a
done key is refused by ``claim`` and continues at its next token after ``purge``, and a filled
row is compared with one the library wrote itself (NULL columns; Redis: fields, encoding, token
counter, the done index). About 100 running leases with task info (half of them expired) are
claimed through the library, so the sweeper has work.

Everything measured goes through ``open_store`` (the library), never the raw driver:

- claim + finish on fresh keys (p50, p95), ``get`` on existing keys (p50, p95);
- ``sweep_expired(limit=100, grace=60)``: median of a few calls, the expired leases taken over
  again with a tiny ttl between calls so every call has the same 50 rows to mark;
- ``purge_older_than(7 days, limit=500)``: one call (the rows' ``updated_at`` are spread over
  the past 14 days, so about half of them are older than the retention);
- the worst (and p99) claim latency seen by ANOTHER process (its own store, its own
  connection) while this one sweeps back to back, sweeps every 50 ms, prunes back to back and
  prunes every 50 ms (a worker's sweeper thread does one sweep and one prune per interval),
  next to the same process's claims with nothing else running (the machine's noise floor);
- operator reads (``--no-ops`` skips them): ``stats()``, ``find(state=running, limit=20)`` (a
  hundred rows running), ``find(state=done, limit=20)`` (every filled row is done),
  ``find(limit=20)`` (every state) and ``effects.find(state=needs_reconciliation)`` (none), the
  median of a few calls each, with the goals of issue 23 (Redis: at most 20 ms each; SQL: find
  at most 20 ms, stats at most 200 ms);
- storage: SQLite file + WAL, PostgreSQL ``pg_total_relation_size`` of the lease table, Redis
  ``used_memory`` delta over the fill (plus an estimate from ``MEMORY USAGE`` samples, which
  other tenants of the shared server cannot disturb);
- the query plans (SQLite ``EXPLAIN QUERY PLAN``, PostgreSQL ``EXPLAIN`` and ``EXPLAIN
  ANALYZE`` in a rolled-back transaction) of the sweep's candidate query and the retention
  query, and whether they use ``lease_celery_leases_sweep`` / ``lease_celery_leases_terminal``.

The small and the big store are measured in alternating rounds (like ``store_cycle.py``), so
a noisy stretch of the shared machine lands on both sides of a ratio instead of deciding it.
The goals of the issue are shown next to the ratios (claim + finish p50 and get p50 at most
1.2x, sweep at most 2x, no claim stalled more than 20 ms by a sweep); missing one does not
change the exit status: this is a measurement, not a test. Exit 1 means the run itself failed.
Needs PostgreSQL and Redis on 127.0.0.1 (the test servers) for those stores.
"""

from __future__ import annotations

import abc
import argparse
import contextlib
import json
import multiprocessing
import os
import random
import signal
import sqlite3
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from multiprocessing.connection import Connection
from multiprocessing.synchronize import Event
from pathlib import Path
from types import FrameType
from typing import Any

from lease_celery import open_store
from lease_celery.models import EffectState, LeaseState
from lease_celery.stores.base import Store
from lease_celery.stores.queries import load_queries

# Loopback only: the test servers of this machine.
PG_DSN = "postgresql://127.0.0.1:5432/test"
REDIS_HOST, REDIS_PORT, REDIS_DB = "127.0.0.1", 6379, 14
STORES = ("sqlite", "postgres", "redis")

DAY = 86400.0
#: The filled rows' updated_at are spread over this many seconds before the fill.
SPREAD = 14 * DAY
RETENTION = 7 * DAY
#: A multiplier that is prime (Knuth's 2654435761): i -> (i * K) % n permutes 0..n-1 for any
#: n it does not divide, so rows are inserted in time order but with scattered keys, as real
#: keys arrive (a sorted key order would pack the primary key unrealistically tight).
SCATTER = 2654435761
#: Fill chunk: one transaction / pipeline each, so no statement or WAL holds a million rows.
CHUNK = 50_000
#: A realistic owner ("hostname:pid:uuid4"): it makes the row as long as a worker's would be.
OWNER = f"scale-host-01:4242:{uuid.UUID(int=0x5CA1E).hex}"
TASK_NAME = "benchmarks.scale.job"
RESULT = {"pages": 3, "ok": True}
LIVE, EXPIRED, STALL_EXTRA = 50, 50, 100
#: Calls of each operator read (the median is reported); a SCAN-based read at a million keys
#: takes seconds, so few.
OPS_CALLS = 5
#: Seconds between the claims of the other process: dense enough to catch any stall of a
#: millisecond or more, sparse enough not to turn the two shared cores into the bottleneck.
CLAIM_PACE = 0.002
#: The other process stops by itself after this long, even if nobody tells it to.
CLAIMER_MAX_SECONDS = 300.0

GOALS: dict[str, tuple[str, float]] = {
    # metric -> (kind, limit): "ratio" limits 1M/1k, "ms" limits the big store's value.
    "claim+finish p50 ms": ("ratio", 1.2),
    "get p50 ms": ("ratio", 1.2),
    "sweep_expired ms (median)": ("ratio", 2.0),
    "claim max, sweeps back to back ms": ("ms", 20.0),
    "claim max, sweeps 50 ms apart ms": ("ms", 20.0),
    # Issue 23, the operator reads at the big size (Redis: 20 ms for stats too).
    "stats() ms": ("ms", 200.0),
    "find(running, 20) ms": ("ms", 20.0),
    "find(done, 20) ms": ("ms", 20.0),
    "find(any, 20) ms": ("ms", 20.0),
    "effects.find(needs_reconciliation) ms": ("ms", 20.0),
}
#: The goals that differ by store.
STORE_GOALS: dict[str, dict[str, tuple[str, float]]] = {"redis": {"stats() ms": ("ms", 20.0)}}


class Deadline:
    """The whole run's time budget, checked between steps (and between fill chunks)."""

    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def check(self, what: str) -> None:
        if time.monotonic() > self.end:
            raise TimeoutError(f"--deadline reached during {what}")


def scatter(i: int, n: int) -> int:
    return (i * SCATTER) % n


def done_key(p: int) -> str:
    return f"done:{p:08d}"


def row_time(i: int, n: int, now: float) -> float:
    """updated_at of the i-th filled row: oldest first, the newest a minute ago."""
    return now - 60.0 - (n - 1 - i) * SPREAD / n


def task_info(key: str) -> dict[str, Any]:
    """What a LeasedTask records on claim, enough for the sweeper to re-publish it."""
    task_id = str(uuid.uuid5(uuid.NAMESPACE_URL, key))  # as long as Celery's ids
    return {"name": TASK_NAME, "id": task_id, "args": [key], "kwargs": {},
            "options": {"task_id": task_id}}


def label(n: int) -> str:
    for size, suffix in ((1_000_000, "M"), (1_000, "k")):
        if n >= size and n % size == 0:
            return f"{n // size}{suffix}"
    return f"{n:,}"


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


# -- targets: one isolated store, filled the fast way -----------------------------------------

class Target(abc.ABC):
    """An isolated store of one kind, holding ``n`` filled rows."""

    name: str

    def __init__(self, n: int, run: str) -> None:
        self.n, self.run = n, run
        self.url = ""
        #: What the store's tokens and fence numbers count up from: 0, or on Redis its epoch's
        #: floor (set by ``init_schema``); a key's first token is base + 1.
        self.base = 0

    @abc.abstractmethod
    def fill(self, now: float, deadline: Deadline) -> None:
        """Write ``n`` settled done rows as the library would have, and set the fence."""

    @abc.abstractmethod
    def storage(self) -> dict[str, float]:
        """What the filled store takes (MiB)."""

    @abc.abstractmethod
    def explain(self) -> dict[str, Any]:
        """The plans of the sweep candidate query and the retention query."""

    @abc.abstractmethod
    def cleanup(self) -> None:
        """Remove everything this target created; safe to call twice or before ``fill``."""

    @abc.abstractmethod
    def shape(self, key: str) -> Any:
        """The stored form of ``key``'s row, values aside: which columns are NULL (SQL), which
        fields exist and the encoding (Redis). A filled row must match a library-written one."""

    def init_schema(self) -> None:
        """Let the library create its schema (tables, partial indexes, version) first, and on
        Redis open the store's epoch: a store holding data without an epoch record is one
        that lost it, and the fill's counters must start above the epoch's floor."""
        with open_store(self.url) as store:
            store.get("scale:init")
            epoch = store.epoch()
            self.base = 0 if epoch is None else epoch.floor


def plan_uses(lines: Sequence[str]) -> dict[str, bool]:
    text = "\n".join(lines)
    return {index: index in text
            for index in ("lease_celery_leases_sweep", "lease_celery_leases_terminal")}


class SQLiteTarget(Target):
    name = "sqlite"
    FILL = """
        WITH RECURSIVE s(i) AS (SELECT :start UNION ALL SELECT i + 1 FROM s WHERE i + 1 < :stop),
        r AS (SELECT i, (i * :scatter) % :n AS p,
                     :now - 60.0 - (:n - 1 - i) * :spread / :n AS t FROM s)
        INSERT INTO lease_celery_leases
               (key, state, owner, token, expires_at, attempts, takeovers, not_before, reason,
                task, result, updated_at, fence, settling, sweep_at, swept_by)
        SELECT printf('done:%08d', p), 'done', :owner, 1, t, 1, 0, NULL, NULL,
               json_object('options', json_object('task_id', printf(
                   '%08d-0000-4000-8000-000000000000', p))),
               '{"n":' || p || ',"ok":true}', t, i + 1, 0, NULL, NULL
        FROM r
    """

    def __init__(self, n: int, run: str, tmp: Path) -> None:
        super().__init__(n, run)
        self.path = tmp / f"scale_{n}.sqlite3"
        self.url = f"sqlite:///{self.path}"  # an absolute path: sqlite:////tmp/...

    def fill(self, now: float, deadline: Deadline) -> None:
        self.init_schema()
        conn = sqlite3.connect(self.path, isolation_level=None, timeout=30)
        try:
            # The fill alone skips fsync; the library's own connections keep synchronous=FULL.
            conn.execute("PRAGMA synchronous=OFF")
            for start in range(0, self.n, CHUNK):
                deadline.check("the sqlite fill")
                conn.execute("BEGIN IMMEDIATE")
                conn.execute(self.FILL, {"start": start, "stop": min(self.n, start + CHUNK),
                                         "n": self.n, "scatter": SCATTER, "now": now,
                                         "spread": SPREAD, "owner": OWNER})
                conn.execute("COMMIT")
            # Every claim bumps the fence: n claims happened.
            conn.execute("UPDATE lease_celery_fence SET value = ? WHERE id = 1", (self.n,))
            # No ANALYZE: the library never runs it, so its stores have no sqlite_stat1 and
            # the plans below are the ones production gets. TRUNCATE empties the WAL so the
            # storage figure is the data, not the fill's transaction size.
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        finally:
            conn.close()

    def shape(self, key: str) -> Any:
        conn = sqlite3.connect(self.path, timeout=30)
        try:
            cur = conn.execute("SELECT * FROM lease_celery_leases WHERE key = ?", (key,))
            row = cur.fetchone()
            return {d[0]: None if v is None else type(v).__name__
                    for d, v in zip(cur.description, row, strict=True)}
        finally:
            conn.close()

    def storage(self) -> dict[str, float]:
        size = sum(p.stat().st_size for p in (self.path, Path(f"{self.path}-wal"))
                   if p.exists())
        return {"storage MiB": size / 2**20}

    def explain(self) -> dict[str, Any]:
        q = load_queries("sqlite")
        now = time.time()
        queries = {
            "sweep_candidates": (q["sweep_candidates"], {"now": now, "grace": 60.0,
                                                         "limit": 100}),
            "retention (retire_old)": (q["retire_old"], {"cutoff": now - RETENTION,
                                                         "limit": 500}),
            "retention (purge_old)": (q["purge_old"], {"cutoff": now - RETENTION,
                                                       "limit": 500}),
        }
        conn = sqlite3.connect(self.path, timeout=30)
        try:
            plans: dict[str, Any] = {}
            for name, (sql, params) in queries.items():
                lines = [str(row[3]) for row in conn.execute(f"EXPLAIN QUERY PLAN {sql}",
                                                             params)]
                plans[name] = {"plan": lines, "uses": plan_uses(lines)}
            (indexed,) = conn.execute("SELECT count(*) FROM lease_celery_leases"
                                      " WHERE sweep_at IS NOT NULL").fetchone()
            return {"plans": plans, "context": {"rows in the sweep index": indexed}}
        finally:
            conn.close()

    def cleanup(self) -> None:
        for path in (self.path, Path(f"{self.path}-wal"), Path(f"{self.path}-shm")):
            path.unlink(missing_ok=True)


class PostgresTarget(Target):
    name = "postgres"
    FILL = """
        INSERT INTO {schema}.lease_celery_leases
               (key, state, owner, token, expires_at, attempts, takeovers, not_before, reason,
                task, swept_token, nonce, result, updated_at, fence, settling, sweep_at,
                swept_by)
        SELECT 'done:' || lpad(p::text, 8, '0'), 'done', %(owner)s, 1, t, 1, 0, NULL, NULL,
               jsonb_build_object('options', jsonb_build_object('task_id',
                   lpad(p::text, 8, '0') || '-0000-4000-8000-000000000000'))::text,
               NULL, md5(i::text), '{"n":' || p || ',"ok":true}', t, i + 1, false,
               NULL, NULL
        FROM (SELECT i, (i * %(scatter)s::bigint) %% %(n)s::bigint AS p,
                     %(now)s::float8 - 60.0
                     - (%(n)s::bigint - 1 - i) * %(spread)s::float8 / %(n)s::bigint AS t
              FROM generate_series(%(start)s::bigint, %(stop)s::bigint - 1) AS i) AS g
    """

    def __init__(self, n: int, run: str) -> None:
        super().__init__(n, run)
        self.schema = f"scale_{run}_{label(n).lower().replace(',', '')}"
        # application_name tags every connection of this target (the library passes it on to
        # libpq), so cleanup can find statements of ours still running on the server.
        self.app_name = f"lease_{self.schema}"
        self.url = f"{PG_DSN}?schema={self.schema}&application_name={self.app_name}"
        self.quoted = f'"{self.schema}"'

    @contextlib.contextmanager
    def connect(self) -> Iterator[Any]:
        import psycopg

        # A bound on every statement of the harness's own: a stuck fill fails, not hangs.
        with psycopg.connect(PG_DSN, autocommit=True, connect_timeout=5,
                             application_name=self.app_name,
                             options="-c statement_timeout=600000") as conn:
            yield conn

    def fill(self, now: float, deadline: Deadline) -> None:
        self.init_schema()
        with self.connect() as conn:
            sql = self.FILL.replace("{schema}", self.quoted)
            for start in range(0, self.n, CHUNK):
                deadline.check("the postgres fill")
                conn.execute(sql, {"start": start, "stop": min(self.n, start + CHUNK),
                                   "n": self.n, "scatter": SCATTER, "now": now,
                                   "spread": SPREAD, "owner": OWNER})
            conn.execute("SELECT setval(%s, %s)", (f"{self.quoted}.lease_celery_fence", self.n))
            # Autovacuum would analyse a table this size within a minute of such a change;
            # without statistics the planner would guess, which production does not do.
            conn.execute(f"VACUUM (ANALYZE) {self.quoted}.lease_celery_leases")

    def shape(self, key: str) -> Any:
        with self.connect() as conn:
            cur = conn.execute(f"SELECT * FROM {self.quoted}.lease_celery_leases"
                               " WHERE key = %s", (key,))
            row = cur.fetchone()
            return {d.name: None if v is None else type(v).__name__
                    for d, v in zip(cur.description or (), row, strict=True)}

    def storage(self) -> dict[str, float]:
        table = f"{self.quoted}.lease_celery_leases"
        with self.connect() as conn:
            total, indexes = conn.execute(
                "SELECT pg_total_relation_size(%s::regclass), pg_indexes_size(%s::regclass)",
                (table, table)).fetchone()
        return {"storage MiB": total / 2**20, "of which indexes MiB": indexes / 2**20}

    def explain(self) -> dict[str, Any]:
        import psycopg

        q = {name: sql.replace("{schema}", self.quoted)
             for name, sql in load_queries("postgres").items()}
        queries: dict[str, tuple[str, dict[str, Any]]] = {
            "sweep": (q["sweep"], {"now": None, "grace": 60.0, "limit": 100,
                                   "nonce": "explain"}),
            "retention (purge_old)": (q["purge_old"], {"now": None, "seconds": RETENTION,
                                                       "limit": 500}),
        }
        plans: dict[str, Any] = {}
        with self.connect() as conn:
            # Client-side binding puts the values in the text, as the library's unnamed
            # server-side statements are planned with their values (a custom plan).
            cur = psycopg.ClientCursor(conn)
            for name, (sql, params) in queries.items():
                lines = [str(r[0]) for r in cur.execute(f"EXPLAIN {sql}", params).fetchall()]
                # ANALYZE runs the UPDATE: inside a transaction that is always rolled back.
                with conn.transaction(force_rollback=True):
                    analyzed = [str(r[0]) for r in cur.execute(
                        f"EXPLAIN (ANALYZE, BUFFERS, TIMING OFF) {sql}", params).fetchall()]
                plans[name] = {"plan": lines, "uses": plan_uses(lines), "analyze": analyzed}
            # What the planner believes about sweep_at (from the last ANALYZE) next to what
            # is there: the sweep's plan depends on it.
            (indexed,) = conn.execute(f"SELECT count(*) FROM {self.quoted}.lease_celery_leases"
                                      " WHERE sweep_at IS NOT NULL").fetchone()
            stats = conn.execute(
                "SELECT null_frac FROM pg_stats WHERE schemaname = %s AND attname = 'sweep_at'"
                " AND tablename = 'lease_celery_leases'", (self.schema,)).fetchone()
        return {"plans": plans, "context": {
            "rows in the sweep index": indexed,
            "sweep_at null_frac in pg_stats": None if stats is None else float(stats[0])}}

    def cleanup(self) -> None:
        with self.connect() as conn:
            # A statement of ours interrupted client-side (a fill, a VACUUM) may still run on
            # the server and hold locks the DROP would wait for: cancel ours, only ours.
            conn.execute("SELECT pg_cancel_backend(pid) FROM pg_stat_activity"
                         " WHERE application_name = %s AND pid <> pg_backend_pid()",
                         (self.app_name,))
            conn.execute("SET lock_timeout = '30s'")
            conn.execute(f"DROP SCHEMA IF EXISTS {self.quoted} CASCADE")


class RedisTarget(Target):
    name = "redis"

    def __init__(self, n: int, run: str) -> None:
        super().__init__(n, run)
        self.prefix = f"scale_{run}_{label(n).lower().replace(',', '')}:"
        self.url = f"redis://{REDIS_HOST}:{REDIS_PORT}/{REDIS_DB}?prefix={self.prefix}"
        self.memory_before = 0

    def client(self) -> Any:
        import redis

        return redis.Redis(host=REDIS_HOST, port=REDIS_PORT, db=REDIS_DB,
                           socket_timeout=60, socket_connect_timeout=5, decode_responses=True)

    def fill(self, now: float, deadline: Deadline) -> None:
        self.init_schema()
        client = self.client()
        try:
            self.memory_before = int(client.info("memory")["used_memory"])
            # The done index (prelude.lua's index_lease): every settled done hash by
            # updated_at, which find(state=done) lists and retention prunes from.
            p, done_index = self.prefix, f"{self.prefix}index:lease:done"
            for start in range(0, self.n, CHUNK):
                deadline.check("the redis fill")
                pipe = client.pipeline(transaction=False)
                scores: dict[str, float] = {}
                for i in range(start, min(self.n, start + CHUNK)):
                    key, t = done_key(scatter(i, self.n)), row_time(i, self.n, now)
                    stamp = f"{t:.6f}"  # the scripts' fmt(): '%.6f'
                    # The fields claim + fenced_write(done, settled at once) leave: claim
                    # sets state..nonce, the counters and the task, finish sets state, the
                    # times and the result, and deletes task (keeping its task id), reason
                    # and swept_by. Deleting
                    # the task info (longer than hash-max-listpack-value) leaves a hashtable,
                    # so the library rewrites a settled hash: it is a compact listpack again,
                    # as this fill writes it (shape() checks the encoding matches).
                    pipe.hset(f"{p}lease:{key}", mapping={
                        "state": "done", "owner": OWNER, "token": str(self.base + 1),
                        "expires_at": stamp, "updated_at": stamp,
                        "fence": str(self.base + i + 1), "nonce": uuid.uuid4().hex,
                        "attempts": "1", "takeovers": "0",
                        "task_id": f"{scatter(i, self.n):08d}-0000-4000-8000-000000000000",
                        "result": f'{{"n":{scatter(i, self.n)},"ok":true}}'})
                    pipe.set(f"{p}token:{key}", str(self.base + 1))  # the counter claim INCRs
                    # fenced_write: ZADD the done index, scored by the updated_at written
                    scores[f"{p}lease:{key}"] = float(stamp)
                pipe.zadd(done_index, scores)
                pipe.execute()
            client.set(f"{p}fence", str(self.base + self.n))
        finally:
            client.close()

    def shape(self, key: str) -> Any:
        client = self.client()
        try:
            name = f"{self.prefix}lease:{key}"
            return {"fields": sorted(client.hkeys(name)),
                    "encoding": client.object("encoding", name),
                    "token counter": client.get(f"{self.prefix}token:{key}") is not None,
                    "in the done index": client.zscore(f"{self.prefix}index:lease:done",
                                                       name) is not None}
        finally:
            client.close()

    def storage(self) -> dict[str, float]:
        client = self.client()
        try:
            delta = int(client.info("memory")["used_memory"]) - self.memory_before
            # used_memory is the whole server's: other engineers' tests move it too. MEMORY
            # USAGE of sampled keys (x n) plus the done index is immune to them.
            sample = random.Random(1).sample(range(self.n), min(200, self.n))
            per_row = statistics.mean(
                int(client.memory_usage(f"{self.prefix}lease:{done_key(k)}") or 0)
                + int(client.memory_usage(f"{self.prefix}token:{done_key(k)}") or 0)
                for k in sample)
            index = int(client.memory_usage(f"{self.prefix}index:lease:done", samples=100) or 0)
        finally:
            client.close()
        return {"storage MiB": delta / 2**20,
                "MEMORY USAGE estimate MiB": (per_row * self.n + index) / 2**20}

    def explain(self) -> dict[str, Any]:
        # No planner: the scripts read the running and state-index sorted sets by score.
        return {"plans": {}, "context": {}}

    def cleanup(self) -> None:
        client = self.client()
        try:
            batch: list[str] = []
            for name in client.scan_iter(match=f"{self.prefix}*", count=5000):
                batch.append(name)
                if len(batch) >= 5000:
                    client.unlink(*batch)
                    batch.clear()
            if batch:
                client.unlink(*batch)
        finally:
            client.close()


# -- measurements (all through the library) ---------------------------------------------------

class Bench:
    """One filled target, opened through the library, with its running leases."""

    def __init__(self, target: Target) -> None:
        self.target = target
        self.store: Store = open_store(target.url)
        self.fresh = 0
        self.expired: list[str] = []
        self.figures: dict[str, float] = {}
        self.samples: dict[str, list[float]] = {"cycle": [], "get": [], "sweep": []}
        self.swept: list[int] = []

    def verify_fill(self, now: float) -> None:
        """The library must read filled rows as done, settled, the key's first token (base +
        1), with their result."""
        n, base = self.target.n, self.target.base
        for i in random.Random(2).sample(range(n), min(50, n)):
            p = scatter(i, n)
            record = self.store.get(done_key(p))
            assert record is not None, f"{self.target.name}: {done_key(p)} not found"
            assert record.state is LeaseState.DONE and not record.settling, record
            assert record.token == base + 1 and record.owner == OWNER, record
            # Of its task info, a settled done row keeps only the task id.
            assert record.task == {"options": {"task_id": f"{p:08d}-0000-4000-8000-"
                                                          f"000000000000"}}, record
            assert record.result == {"n": p, "ok": True} and record.fence == base + i + 1, record
            assert abs((record.updated_at or 0) - row_time(i, n, now)) < 1e-3, record
        # A key the library itself claimed (with task info, as a LeasedTask does) and
        # finished is stored in the same shape as a filled one.
        reference = "scale:reference"
        lease = self.store.claim(reference, owner=OWNER, ttl=30, task=task_info(reference))
        assert lease is not None and self.store.finish(lease, RESULT)
        filled, written = self.target.shape(done_key(scatter(1, n))), self.target.shape(reference)
        assert filled == written, f"{self.target.name}: filled {filled} != library {written}"
        key = done_key(scatter(0, n))
        assert self.store.claim(key, owner="check", ttl=30) is None, "a done key was claimed"
        # A purged filled key continues at its second token: the fill left tokens the library
        # honours.
        assert self.store.purge(key), f"{key} could not be purged"
        lease = self.store.claim(key, owner="check", ttl=30)
        assert lease is not None and lease.token == base + 2, lease
        assert self.store.finish(lease, RESULT)

    def add_running(self) -> None:
        """~100 running leases with task info, half of them already expired."""
        for i in range(LIVE):
            key = f"run:live:{i}"
            assert self.store.claim(key, owner=OWNER, ttl=3600, task=task_info(key))
        self.expired = [f"run:expired:{i}" for i in range(EXPIRED)]
        self.reexpire()

    def reexpire(self) -> None:
        """(Re)claim the expired leases with a tiny ttl, so a sweep finds them due again."""
        for key in self.expired:
            assert self.store.claim(key, owner=OWNER, ttl=0.005, task=task_info(key)), key
        time.sleep(0.03)

    def cycles(self, count: int, record: bool = True) -> None:
        for _ in range(count):
            key = f"fresh:{self.fresh}"
            self.fresh += 1
            start = time.perf_counter()
            lease = self.store.claim(key, owner=OWNER, ttl=30, task=task_info(key))
            assert lease is not None and self.store.finish(lease, RESULT), key
            if record:
                self.samples["cycle"].append(time.perf_counter() - start)

    def gets(self, count: int, rng: random.Random, record: bool = True) -> None:
        for p in (rng.randrange(self.target.n) for _ in range(count)):
            start = time.perf_counter()
            found = self.store.get(done_key(p))
            elapsed = time.perf_counter() - start
            assert found is not None, done_key(p)
            if record:
                self.samples["get"].append(elapsed)

    def sweep(self) -> None:
        self.reexpire()
        start = time.perf_counter()
        swept = self.store.sweep_expired(limit=100, grace=60)
        self.samples["sweep"].append(time.perf_counter() - start)
        self.swept.append(len(swept))

    def purge(self) -> None:
        start = time.perf_counter()
        purged = self.store.purge_older_than(RETENTION, limit=500)
        self.figures["purge_older_than ms (limit 500)"] = (time.perf_counter() - start) * 1e3
        self.figures["purged rows"] = purged

    def ops(self) -> None:
        """The operator's reads (celery leases stats / list --state ..., the dashboard's
        lists): the median of OPS_CALLS calls each, after one call not counted (on a Redis
        prefix without indexes that one would build them; a filled prefix has them)."""
        reads: dict[str, Callable[[], Any]] = {
            "stats() ms": self.store.stats,
            "find(running, 20) ms": lambda: self.store.find(state=LeaseState.RUNNING,
                                                            limit=20),
            "find(done, 20) ms": lambda: self.store.find(state=LeaseState.DONE, limit=20),
            "find(any, 20) ms": lambda: self.store.find(limit=20),
            "effects.find(needs_reconciliation) ms": lambda: self.store.effects.find(
                state=EffectState.NEEDS_RECONCILIATION, limit=20),
        }
        answers = {name: read() for name, read in reads.items()}
        stats = answers["stats() ms"]
        assert stats.counts.get("done", 0) >= self.target.n, stats
        assert len(answers["find(running, 20) ms"]) == 20, answers["find(running, 20) ms"]
        assert len(answers["find(done, 20) ms"]) == 20
        assert len(answers["find(any, 20) ms"]) == 20
        for name, read in reads.items():
            calls = []
            for _ in range(OPS_CALLS):
                start = time.perf_counter()
                read()
                calls.append((time.perf_counter() - start) * 1e3)
            self.figures[name] = statistics.median(calls)

    def summarize(self) -> None:
        ms = 1e3
        self.figures["claim+finish p50 ms"] = statistics.median(self.samples["cycle"]) * ms
        self.figures["claim+finish p95 ms"] = percentile(self.samples["cycle"], 0.95) * ms
        self.figures["get p50 ms"] = statistics.median(self.samples["get"]) * ms
        self.figures["get p95 ms"] = percentile(self.samples["get"], 0.95) * ms
        self.figures["sweep_expired ms (median)"] = statistics.median(self.samples["sweep"]) * ms
        self.figures["rows per sweep (min)"] = min(self.swept)

    def close(self) -> None:
        self.store.close()


def _claimer(url: str, tag: str, ready: Event, stop: Event, out: Connection) -> None:
    """The other process: claims fresh keys every CLAIM_PACE s; sends (start, seconds) back.

    time.monotonic is CLOCK_MONOTONIC, one clock for every process of the machine, so the
    parent can tell which claims started inside its sweep windows.
    """
    parent, started = os.getppid(), time.monotonic()
    samples: list[tuple[float, float]] = []
    with open_store(url) as store:
        for i in range(20):  # connect, load scripts, warm the page cache
            store.claim(f"claimer:{tag}:warm:{i}", owner=OWNER, ttl=30)
        ready.set()
        i, next_at = 0, time.monotonic()
        # Stops when told, when its parent is gone, or after CLAIMER_MAX_SECONDS regardless.
        while (not stop.is_set() and os.getppid() == parent
               and time.monotonic() - started < CLAIMER_MAX_SECONDS):
            key = f"claimer:{tag}:{i}"
            begin = time.monotonic()
            lease = store.claim(key, owner=OWNER, ttl=30, task=task_info(key))
            samples.append((begin, time.monotonic() - begin))
            assert lease is not None, key
            i += 1
            next_at += CLAIM_PACE
            pause = next_at - time.monotonic()
            if pause > 0:
                time.sleep(pause)
            else:
                next_at = time.monotonic()
    out.send(samples)
    out.close()


#: The other process's windows: (name, what this process does meanwhile, pause after each).
#: Back to back is the worst case the goal names; 50 ms apart lets a claim meet one call at a
#: time, so its stall is closer to that call's own (SQLite's busy retry is a jittered poll,
#: not a fair queue: a writer that takes the lock again at once can starve it). A worker's
#: sweeper thread does one sweep and one prune every lease_sweep_interval.
STALL_WINDOWS = (("alone", "", 0.0),
                 ("sweeps back to back", "sweep", 0.0), ("sweeps 50 ms apart", "sweep", 0.05),
                 ("prunes back to back", "prune", 0.0), ("prunes 50 ms apart", "prune", 0.05))


def stall(bench: Bench, window: float, deadline: Deadline) -> None:
    """Claims of another process: alone, while this one sweeps, while it prunes."""
    store = bench.store
    # Enough expired rows for a full batch of 100 on every sweep of the loop. grace=0 in the
    # loop: a marked row is due again at once, so every sweep marks 100 rows (with grace=60
    # only the first would find work and the rest would measure an empty index read).
    for i in range(STALL_EXTRA):
        key = f"stall:expired:{i}"
        assert store.claim(key, owner=OWNER, ttl=0.005, task=task_info(key))
    time.sleep(0.03)
    actions: dict[str, Callable[[], int]] = {
        "sweep": lambda: len(store.sweep_expired(limit=100, grace=0)),
        "prune": lambda: store.purge_older_than(RETENTION, limit=500),
    }
    ctx = multiprocessing.get_context("spawn")  # a fresh process: no inherited connections
    ready, stop = ctx.Event(), ctx.Event()
    receiver, sender = ctx.Pipe(duplex=False)
    tag = uuid.uuid4().hex[:8]
    proc = ctx.Process(target=_claimer, args=(bench.target.url, tag, ready, stop, sender),
                       daemon=True)
    proc.start()
    sender.close()
    spans: dict[str, tuple[float, float]] = {}
    try:
        if not ready.wait(60):
            raise TimeoutError("the claiming process did not start within 60 s")
        for name, action, pause in STALL_WINDOWS:
            deadline.check(f"the window {name!r}")
            calls: list[float] = []
            rows = 0
            begin = time.monotonic()
            while time.monotonic() - begin < window:
                if not action:
                    time.sleep(window)
                    continue
                call = time.perf_counter()
                rows += actions[action]()
                calls.append((time.perf_counter() - call) * 1e3)
                if pause:
                    time.sleep(pause)
            spans[name] = (begin, time.monotonic())
            if calls:
                bench.figures[f"{name}: calls"] = len(calls)
                bench.figures[f"{name}: rows per call"] = rows / len(calls)
                bench.figures[f"{name}: call p50 ms"] = statistics.median(calls)
        stop.set()
        if not receiver.poll(60):
            raise TimeoutError("the claiming process sent no samples within 60 s")
        samples: list[tuple[float, float]] = receiver.recv()
    finally:
        stop.set()
        proc.join(10)
        if proc.is_alive():
            proc.terminate()  # our own child, by its handle
            proc.join(5)
        receiver.close()
    for name, (lo, hi) in spans.items():
        inside = [seconds * 1e3 for begin, seconds in samples if lo <= begin <= hi]
        if not inside:
            raise RuntimeError(f"no claim of the other process started during {name}")
        bench.figures[f"claim max, {name} ms"] = max(inside)
        bench.figures[f"claim p99, {name} ms"] = percentile(inside, 0.99)


def alternate(benches: Sequence[Bench], step: Callable[[Bench], None], rounds: int) -> None:
    """Run ``step`` on each bench in turn, ``rounds`` times, the order flipping every round."""
    for r in range(rounds):
        for bench in benches if r % 2 == 0 else list(reversed(benches)):
            step(bench)


def measure_store(name: str, sizes: Sequence[int], args: argparse.Namespace, tmp: Path,
                  run: str, deadline: Deadline) -> dict[str, Any]:
    targets: list[Target] = []
    for n in sizes:
        if name == "sqlite":
            targets.append(SQLiteTarget(n, run, tmp))
        elif name == "postgres":
            targets.append(PostgresTarget(n, run))
        else:
            targets.append(RedisTarget(n, run))
    benches: list[Bench] = []
    result: dict[str, Any] = {"store": name, "run": run, "sizes": list(sizes), "figures": {},
                              "explain": {}}
    started = time.monotonic()
    try:
        for target in targets:
            fill_start, now = time.monotonic(), time.time()
            target.fill(now, deadline)
            fill_seconds = time.monotonic() - fill_start
            bench = Bench(target)
            benches.append(bench)
            bench.figures["fill s"] = fill_seconds
            bench.figures.update(target.storage())
            bench.figures["storage bytes/row"] = bench.figures["storage MiB"] * 2**20 / target.n
            bench.verify_fill(now)
            bench.add_running()
            log(f"{name}: {target.n:,} rows filled in {fill_seconds:.1f}s and verified")
            if not args.no_ops:
                # Now, before the next size is filled: a Redis prefix still without indexes
                # (the version before) lists by SCAN over the whole database, and the small
                # store's figure would include a walk over the big one's keys.
                deadline.check("the operator reads")
                bench.ops()
        rng = random.Random(3)
        for bench in benches:  # warm-up: connections, scripts, the hot pages
            bench.cycles(20, record=False)
            bench.gets(50, rng, record=False)
        rounds = 5
        alternate(benches, lambda b: b.cycles(max(1, args.cycles // rounds)), rounds)
        alternate(benches, lambda b: b.gets(max(1, args.gets // rounds), rng), rounds)
        alternate(benches, Bench.sweep, rounds)
        deadline.check("the timed operations")
        for bench in benches:
            bench.purge()
            bench.summarize()
        for bench in benches:
            log(f"{name}: {bench.target.n:,} rows: claims of another process during sweeps")
            stall(bench, args.window, deadline)
        for bench in benches:
            result["explain"][str(bench.target.n)] = bench.target.explain()
        for bench in benches:
            result["figures"][str(bench.target.n)] = bench.figures
    finally:
        for bench in benches:
            bench.close()
        for target in targets:
            try:
                target.cleanup()
            except Exception as exc:  # report it, and still clean the others up
                log(f"{name}: cleanup of {target.url} failed: {exc}")
                result.setdefault("cleanup_errors", []).append(str(exc))
    result["seconds"] = time.monotonic() - started
    return result


# -- output ---------------------------------------------------------------------------------

def goal_text(metric: str, small: float, big: float, store: str = "") -> tuple[str, str]:
    goal = STORE_GOALS.get(store, {}).get(metric) or GOALS.get(metric)
    if goal is None:
        return "", ""
    kind, limit = goal
    if kind == "ratio":
        ok = small > 0 and big / small <= limit
        return f"<= {limit:g}x", "ok" if ok else "MISSED"
    return f"<= {limit:g} ms", "ok" if big <= limit else "MISSED"


def number(value: float) -> str:
    if abs(value) >= 100 or float(value).is_integer():
        return f"{value:,.0f}"
    return f"{value:.1f}" if abs(value) >= 10 else f"{value:.3f}"


def table(result: dict[str, Any]) -> str:
    small_n, big_n = result["sizes"]
    small, big = result["figures"][str(small_n)], result["figures"][str(big_n)]
    head = (f"{'metric':<34}{label(small_n):>12}{label(big_n):>12}"
            f"{label(big_n) + '/' + label(small_n):>10}  {'goal':<12}")
    lines = [f"== {result['store']} ({small_n:,} vs {big_n:,} done rows; run {result['run']};"
             f" {result['seconds']:.0f}s) ==", head, "-" * len(head)]
    for metric in small:
        a, b = small[metric], big[metric]
        ratio = f"{b / a:.2f}x" if a else "-"
        goal, verdict = goal_text(metric, a, b, result["store"])
        lines.append(f"{metric:<34}{number(a):>12}{number(b):>12}{ratio:>10}  {goal:<12}"
                     f"{verdict}".rstrip())
    explained = result["explain"].get(str(big_n), {"plans": {}, "context": {}})
    plans = explained["plans"]
    if plans:
        context = ", ".join(f"{k}: {v}" for k, v in explained["context"].items())
        lines.append(f"query plans at {big_n:,} rows ({context}):")
    for name, plan in plans.items():
        uses = ", ".join(f"{index}: {'yes' if used else 'NO'}"
                         for index, used in plan["uses"].items())
        lines.append(f"  {name}: {uses}")
        lines.extend(f"    {line}" for line in plan["plan"])
        if "analyze" in plan:
            lines.append("    -- EXPLAIN (ANALYZE, BUFFERS), rolled back:")
            lines.extend(f"    {line}" for line in plan["analyze"])
    return "\n".join(lines)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def check_servers(stores: Sequence[str]) -> None:
    if "postgres" in stores:
        import psycopg

        with psycopg.connect(PG_DSN, connect_timeout=5):
            pass
    if "redis" in stores:
        import redis

        client = redis.Redis(host=REDIS_HOST, port=REDIS_PORT, db=REDIS_DB,
                             socket_connect_timeout=5)
        try:
            client.ping()
            if client.dbsize():
                log(f"note: redis db {REDIS_DB} is not empty; the memory delta may include "
                    "another tenant's writes (the MEMORY USAGE estimate does not)")
        finally:
            client.close()


def _terminate(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)  # unwinds through the finally blocks: cleanup runs


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--stores", default=",".join(STORES))
    parser.add_argument("--small", type=int, default=1_000)
    parser.add_argument("--big", type=int, default=1_000_000)
    parser.add_argument("--cycles", type=int, default=500, help="claim+finish cycles per size")
    parser.add_argument("--gets", type=int, default=2000, help="gets per size")
    parser.add_argument("--window", type=float, default=2.0,
                        help="seconds of each sweep / prune window per size")
    parser.add_argument("--no-ops", action="store_true", help="skip stats() and find()")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser.add_argument("--deadline", type=float, default=3600.0,
                        help="seconds for the whole run; past it the run stops and cleans up")
    args = parser.parse_args(argv)
    stores = [s.strip() for s in args.stores.split(",") if s.strip()]
    unknown = sorted(set(stores) - set(STORES))
    if unknown or not stores:
        parser.error(f"unknown store(s) {unknown}; known: {', '.join(STORES)}")
    if not 100 <= args.small < args.big:
        parser.error("need 100 <= --small < --big")
    signal.signal(signal.SIGTERM, _terminate)
    check_servers(stores)
    deadline = Deadline(args.deadline)
    started = time.monotonic()
    results = []
    # One id per run names everything it creates: schemas scale_<run>_<size>, Redis prefixes
    # scale_<run>_<size>:, the temporary directory lease_scale_<run>_*.
    run = uuid.uuid4().hex[:8]
    with tempfile.TemporaryDirectory(prefix=f"lease_scale_{run}_") as tmp:
        for name in stores:
            results.append(measure_store(name, (args.small, args.big), args, Path(tmp), run,
                                         deadline))
            if not args.json:
                print(table(results[-1]), end="\n\n", flush=True)
    wall = time.monotonic() - started
    if args.json:
        print(json.dumps({"results": results, "wall_seconds": wall}, indent=1))
    else:
        print(f"wall time: {wall:.0f}s")
    return 1 if any(r.get("cleanup_errors") for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
