"""Tasks per second through real prefork workers: plain Celery, LeasedTask, celery-once, -singleton.

    python benchmarks/worker_throughput.py
        [--variants plain,sqlite,postgres,redis,mysql,once,singleton]
        [--body noop,10ms] [--tasks noop=2000,10ms=500 | --tasks N] [--rounds 3] [--json]

One ``celery worker -P prefork -c 2`` per variant (tasks in
``benchmarks/worker_throughput_app.py``), Redis broker on database 9 with every key under a
prefix of the run, ``task_acks_late``, prefetch multiplier 4, ``ignore_result``. Stores: SQLite
in a temporary file, PostgreSQL in a schema of the run's own (dropped after), Redis database 14
under the run's prefix (deleted after). celery-once and celery-singleton lock on the broker's
Redis (needs the ``bench`` dependency group: ``pip install -e . --group bench``).

What the store's history costs a task: ``--variants plain,sqlite,sqlite-nohistory`` (and
``postgres-nohistory``) adds the same store in a file or schema of its own, whose history
triggers are dropped after the warm-up; the run fails if that store still wrote history.
What the finish behind the return changes: ``--variants plain,sqlite,sqlite-inline`` (and
``postgres-inline``, ``redis-inline``) adds a worker of the same store whose tasks finish in
the task (``lease_finish_in_background=False``). What a task costs the worker at a lease
variant's rate without lease_celery: ``--variants plain,redis,plain-busy`` adds plain tasks
whose body first spends 400 µs of CPU in a busy loop (``worker_variants.BUSY``): their
``main`` column is the main process's cost per task at that lower rate.

A *batch* is N tasks of one variant and body. The harness publishes all N while that
variant's worker is paused (SIGSTOP of its process group: it cannot start early and compete
with the publisher for the two cores), resumes it, and the rate is N divided by the time from
the first task's start to the last task's end as the pool processes saw them (``task_prerun``
/ ``task_postrun``). All other workers stay paused while one is measured. Every worker runs a
warm-up batch first, so connecting to the store, creating the schema and the first imports are
not counted.

Noise is handled by alternation: in every round and body the batches run plain, v1, plain, v2,
..., plain (the order of v1, v2, ... rotates from round to round) and each variant's ratio is
its rate divided by the mean of the two plain batches around it. The table shows the median
over rounds. ``publish/s`` is the publisher's own rate: celery-once and celery-singleton take
their lock at publish time, which the worker-side rate does not see.

CPU per task, by process: user + system time (``/proc/<pid>/stat``; the Redis server's from
its own ``INFO cpu``, in microseconds where /proc counts 10 ms ticks) over the batch, from the
resume to the last settle confirmation, divided by its tasks: the worker (its main process and
pool processes), the Redis server (the broker, and the store of the ``redis`` variant) and
every PostgreSQL server process (the ``postgres`` variants' store) and the MariaDB server
(``mariadbd``, the ``mysql`` variant's: database ``bench_<run>``). SQLite's cost is in the
worker's. ``+worker`` is the variant's worker CPU minus the mean of the plain batches around
it (the same alternation as the ratio): what the library costs the machine per task, steadier
than the rate on a busy machine. Other tenants of the shared Redis and PostgreSQL servers land
in their figures too: run on a quiet machine.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import importlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import FrameType, ModuleType
from typing import Any

REPO = Path(__file__).resolve().parent.parent
# Loopback only: the test servers of this machine.
REDIS_HOST = "127.0.0.1"
REDIS_PORT = int(os.environ.get("BENCH_REDIS_PORT", "6379"))
BROKER_DB, STORE_DB = 9, 14
PG_DSN = "postgresql://127.0.0.1:5432/test"
MYSQL_URL = "mysql://root@127.0.0.1:3306"
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # run as a script, only benchmarks/ is on it

from benchmarks.worker_variants import (  # noqa: E402
    BUSY,
    CARRIED,
    DEFAULT_VARIANTS,
    INLINE,
    NO_HISTORY,
    VARIANTS,
)

DEFAULT_TASKS = {"noop": 2000, "10ms": 500}
#: Each store, and the environment variable holding its URL.
_STORE_ENV = {"sqlite": "BENCH_SQLITE_URL", "postgres": "BENCH_POSTGRES_URL",
              "redis": "BENCH_REDIS_STORE_URL", "mysql": "BENCH_MYSQL_URL"}
#: The lease variants, and the environment variable holding each one's store URL (the inline
#: and carried variants use their store's own).
STORE_ENV = {**_STORE_ENV,
             "sqlite-nohistory": "BENCH_SQLITE_NOHISTORY_URL",
             "postgres-nohistory": "BENCH_POSTGRES_NOHISTORY_URL",
             **{variant: _STORE_ENV[store] for variant, store in {**INLINE, **CARRIED}.items()}}
#: The store's history triggers (lease_celery/stores/sql/*.sql, schema 5).
HISTORY_TRIGGERS = ("lease_celery_history_new_key", "lease_celery_history_transition")

#: Seconds a worker may take to announce it is ready (six booting at once on two cores).
READY_TIMEOUT = 90.0
#: Seconds the settle confirmations / lock releases of a finished batch may take to land.
QUIET_TIMEOUT = 15.0
#: Seconds a warm shutdown may take before the worker's process group is killed.
STOP_TIMEOUT = 10.0
POLL = 0.02


def batch_timeout(tasks: int, body_seconds: float) -> float:
    """A generous bound on one batch: 20 tasks/s on a very busy machine, plus the bodies."""
    return 30.0 + tasks * (0.05 + body_seconds)


def _mysql_admin(statement: str) -> None:
    """One statement on the MySQL test server (the ``mysql`` variant's database)."""
    import pymysql

    conn = pymysql.connect(host="127.0.0.1", port=3306, user="root", autocommit=True)
    try:
        with conn.cursor() as cur:
            cur.execute(statement)
    finally:
        conn.close()


# -- workers -------------------------------------------------------------------------------

def _die_with_parent() -> None:
    """In the worker's main process before exec: SIGKILL it if the harness dies (even by
    SIGKILL, where no ``finally`` runs). Its pool processes already die with it (Celery sets
    the same for them), so nothing outlives the harness."""
    os.setsid()  # a process group of its own, to pause and kill it whole
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


@dataclass
class Worker:
    variant: str
    queue: str
    hostname: str
    process: subprocess.Popen[bytes]
    log: Path

    def alive(self) -> bool:
        return self.process.poll() is None

    def _signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, sig)

    def pause(self) -> None:
        self._signal(signal.SIGSTOP)

    def resume(self) -> None:
        self._signal(signal.SIGCONT)

    def terminate(self) -> None:
        """Ask for a warm shutdown (``Run.stop_workers`` bounds it and kills the rest)."""
        self._signal(signal.SIGCONT)  # a stopped process would never see the SIGTERM
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL the whole group: pool processes can outlive their main process."""
        self._signal(signal.SIGCONT)
        self._signal(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(STOP_TIMEOUT)

    def tail(self, lines: int = 40) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


class WorkerFailed(RuntimeError):
    pass


# -- one run -------------------------------------------------------------------------------

#: The processes whose CPU a batch reports, each a column of the table (and, in the JSON
#: ``worker_main``: the worker's main process alone, shown beside the pool processes' rest).
CPU_PARTS = ("worker", "redis", "postgres", "mariadbd")
CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _proc_stat(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name (which may hold spaces), or
    None for a process that is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2:].split()


def _cpu_of(pid: int) -> float:
    """Seconds of user + system CPU ``pid`` has used (0 for a process that is gone)."""
    fields = _proc_stat(pid)
    return 0.0 if fields is None else (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def _all_pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def process_tree(root: int) -> list[int]:
    """``root`` and every process below it (a worker: its main process and pool processes)."""
    parents: dict[int, list[int]] = {}
    for pid in _all_pids():
        fields = _proc_stat(pid)
        if fields is not None:
            parents.setdefault(int(fields[1]), []).append(pid)
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo += parents.get(pid, [])
    return tree


def processes_named(name: str) -> list[int]:
    """Every process whose command name is ``name`` (PostgreSQL: a process per connection)."""
    found = []
    for pid in _all_pids():
        try:
            if Path(f"/proc/{pid}/comm").read_text().strip() == name:
                found.append(pid)
        except OSError:
            continue
    return found


class CpuMeter:
    """CPU seconds per part (``CPU_PARTS``) between two readings: a process that starts in
    between counts from zero, one that ends in between is lost (PostgreSQL backends of the
    pool, which stay connected, rarely do).

    The Redis server's figure is its own account (``INFO cpu``: getrusage, in microseconds):
    /proc counts in clock ticks (10 ms), more than the broker spends on a small batch."""

    def __init__(self, worker_pid: int, redis: Any = None) -> None:
        self.worker_pid, self.redis = worker_pid, redis

    def _redis_cpu(self) -> dict[int, float]:
        if self.redis is None:
            return {}
        info = self.redis.info("cpu")
        return {0: float(info["used_cpu_user"]) + float(info["used_cpu_sys"])}

    def read(self) -> dict[str, dict[int, float]]:
        parts = {"worker": process_tree(self.worker_pid), "worker_main": [self.worker_pid],
                 "postgres": processes_named("postgres"),
                 "mariadbd": processes_named("mariadbd")}
        read = {part: {pid: _cpu_of(pid) for pid in pids} for part, pids in parts.items()}
        return {**read, "redis": self._redis_cpu()}

    @staticmethod
    def spent(before: dict[str, dict[int, float]],
              after: dict[str, dict[int, float]]) -> dict[str, float]:
        return {part: sum(max(0.0, cpu - before[part].get(pid, 0.0))
                          for pid, cpu in after[part].items())
                for part in after}


@dataclass
class Batch:
    variant: str
    body: str
    round: int
    tasks: int
    rate: float  # tasks/s, worker side
    seconds: float  # first start -> last end
    publish_rate: float  # tasks/s, publisher side
    cpu_us: dict[str, float] = field(default_factory=dict)  # CPU_PARTS -> µs per task
    ratio: float | None = None  # filled in for non-plain batches
    extra_worker_us: float | None = None  # worker µs/task over the plain batches around it


@dataclass
class Row:
    variant: str
    body: str
    tasks: int
    rates: list[float] = field(default_factory=list)
    ratios: list[float] = field(default_factory=list)
    publish_rates: list[float] = field(default_factory=list)
    cpu_us: dict[str, list[float]] = field(default_factory=dict)
    extra_worker_us: list[float] = field(default_factory=list)

    def cpu_median(self, part: str) -> float:
        return statistics.median(self.cpu_us[part])

    @property
    def extra_worker_median(self) -> float | None:
        return statistics.median(self.extra_worker_us) if self.extra_worker_us else None

    @property
    def rate_median(self) -> float:
        return statistics.median(self.rates)

    @property
    def ratio_median(self) -> float | None:
        return statistics.median(self.ratios) if self.ratios else None

    @property
    def publish_median(self) -> float:
        return statistics.median(self.publish_rates)


class Run:
    """The servers' names, the workers and the clean-up of one benchmark run."""

    def __init__(self, variants: list[str], tmp: Path, loglevel: str,
                 logs: Path | None = None) -> None:
        import redis

        self.variants, self.tmp, self.loglevel = variants, tmp, loglevel
        self.logs = logs or tmp
        self.id = uuid.uuid4().hex[:10]
        self.prefix = f"bench_{self.id}:"
        self.schema = f"bench_{self.id}"
        self.schemas = [self.schema, f"{self.schema}_nohistory"]
        self.broker_url = f"redis://{REDIS_HOST}:{REDIS_PORT}/{BROKER_DB}"
        self.store_redis_url = f"redis://{REDIS_HOST}:{REDIS_PORT}/{STORE_DB}"
        self.env = {
            "BENCH_PREFIX": self.prefix,
            "BENCH_BROKER": self.broker_url,
            # BENCH_SQLITE_QUERY="?synchronous=normal" measures the no-fsync SQLite mode.
            "BENCH_SQLITE_URL": f"sqlite:///{tmp / 'leases.sqlite3'}"
                                f"{os.environ.get('BENCH_SQLITE_QUERY', '')}",
            "BENCH_POSTGRES_URL": f"{PG_DSN}?schema={self.schema}",
            "BENCH_SQLITE_NOHISTORY_URL": f"sqlite:///{tmp / 'leases-nohistory.sqlite3'}"
                                          f"{os.environ.get('BENCH_SQLITE_QUERY', '')}",
            "BENCH_POSTGRES_NOHISTORY_URL": f"{PG_DSN}?schema={self.schemas[1]}",
            "BENCH_REDIS_STORE_URL": f"{self.store_redis_url}?prefix={self.prefix}",
            "BENCH_MYSQL_URL": f"{MYSQL_URL}/{self.schema}",
        }
        self.redis = redis.Redis.from_url(self.broker_url, socket_timeout=10,
                                          socket_connect_timeout=5, decode_responses=True)
        self.workers: dict[str, Worker] = {}
        self.stores: dict[str, Any] = {}
        self._history_rows: dict[str, int] = {}  # no-history variant -> entries at the drop
        self.app_module: ModuleType | None = None
        self._batches = 0

    # -- set-up --------------------------------------------------------------------------

    def load_app(self) -> ModuleType:
        """Import the app module in this process (the publisher), with every variant's task
        registered: celery-once and celery-singleton lock in ``apply_async``."""
        os.environ.update(self.env, BENCH_VARIANTS=",".join(self.variants))
        self.app_module = importlib.import_module("benchmarks.worker_throughput_app")
        return self.app_module

    def start_workers(self) -> None:
        if "mysql" in self.variants:  # the store makes its tables, not its database
            _mysql_admin(f"CREATE DATABASE IF NOT EXISTS `{self.schema}`")
        # Start them all, then wait: their boots overlap instead of adding up.
        for variant in self.variants:
            self.workers[variant] = self._spawn(variant)
        for worker in self.workers.values():
            self._wait_ready(worker)
        for worker in self.workers.values():
            self._warm_up(worker)
        for variant in self.variants:
            if variant in NO_HISTORY:
                self._drop_history(variant)

    def _drop_history(self, variant: str) -> None:
        """Turn off the history triggers of a no-history variant's store, after the warm-up
        (a PostgreSQL store of the current schema version never creates them again)."""
        self._store(variant)  # the harness's own connection, opened before the drop too
        table = "lease_celery_leases"
        statements = []
        for trigger, event in zip(HISTORY_TRIGGERS, ("INSERT", "UPDATE"), strict=True):
            if NO_HISTORY[variant] == "sqlite":
                # Every new SQLite connection creates the triggers it does not find (IF NOT
                # EXISTS): each is replaced by one of the same name that never fires, in one
                # transaction (a connection opened in between would find none).
                statements += [f"DROP TRIGGER IF EXISTS {trigger}",
                               f"CREATE TRIGGER {trigger} AFTER {event} ON {table} "
                               "WHEN 0 BEGIN SELECT 1; END"]
            else:
                statements.append(f'DROP TRIGGER IF EXISTS {trigger} ON '
                                  f'"{self.schemas[1]}".{table}')
        self._sql(variant, *statements)
        self._history_rows[variant] = self._count_history(variant)

    def _sql(self, variant: str, *statements: str) -> list[tuple[Any, ...]]:
        """Statements on a no-history variant's store, in one transaction on a connection of
        its own; the last one's rows."""
        rows: list[tuple[Any, ...]] = []
        if NO_HISTORY[variant] == "sqlite":
            import sqlite3

            path = self._store(variant).path  # the file the store's URL names
            with contextlib.closing(sqlite3.connect(path, timeout=30,
                                                    isolation_level=None)) as conn:
                conn.execute("BEGIN IMMEDIATE")
                for statement in statements:
                    rows = conn.execute(statement).fetchall()
                conn.execute("COMMIT")
            return rows
        import psycopg

        with psycopg.connect(PG_DSN, connect_timeout=5) as conn:  # commits on leaving
            for statement in statements:
                cursor = conn.execute(statement)
                rows = cursor.fetchall() if cursor.description else []
        return rows

    def _count_history(self, variant: str) -> int:
        schema = "" if NO_HISTORY[variant] == "sqlite" else f'"{self.schemas[1]}".'
        return int(self._sql(variant, f"SELECT count(*) FROM {schema}lease_celery_history")[0][0])

    def check_no_history(self) -> None:
        """A no-history variant whose store still wrote history measured nothing: fail."""
        for variant, before in self._history_rows.items():
            written = self._count_history(variant) - before
            if written:
                raise WorkerFailed(f"{variant}: {written} history entries were written after "
                                   "its triggers were dropped")

    def _spawn(self, variant: str) -> Worker:
        queue = f"bench.{variant}"
        hostname = f"{variant}-{self.id}@{os.uname().nodename}"
        log = self.logs / f"worker-{variant}-{self.id}.log"
        env = {**os.environ, **self.env, "BENCH_VARIANTS": variant,
               "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO),
                                                           os.environ.get("PYTHONPATH")]))}
        cmd = [sys.executable, "-m", "celery", "-A", "benchmarks.worker_throughput_app", "worker",
               "-P", "prefork", "-c", "2", "-Q", queue, "-n", hostname,
               "--without-gossip", "--without-mingle", "--without-heartbeat",
               "-l", self.loglevel]
        # preexec_fn is unsafe once the harness has threads: workers are all spawned before
        # it opens a lease store (the heartbeat and the sweeper start threads).
        with log.open("wb") as out:
            process = subprocess.Popen(cmd, cwd=self.tmp, env=env, stdout=out,
                                       stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                       preexec_fn=_die_with_parent)
        return Worker(variant, queue, hostname, process, log)

    def _wait_ready(self, worker: Worker) -> None:
        deadline = time.monotonic() + READY_TIMEOUT
        while not self.redis.exists(f"{self.prefix}ready:{worker.hostname}"):
            if not worker.alive():
                raise WorkerFailed(f"worker {worker.variant} exited with "
                                   f"{worker.process.returncode}:\n{worker.tail()}")
            if time.monotonic() > deadline:
                raise WorkerFailed(f"worker {worker.variant} not ready after {READY_TIMEOUT}s:"
                                   f"\n{worker.tail()}")
            time.sleep(0.1)

    def _warm_up(self, worker: Worker) -> None:
        """A few tasks of each body, not measured: each pool process imports, connects and
        (PostgreSQL) creates the schema here. Sleeping bodies make sure both processes work."""
        for body, tasks in (("10ms", 8), ("noop", 40)):
            self.batch(worker.variant, body, tasks, round_=-1)

    # -- a batch -------------------------------------------------------------------------

    def batch(self, variant: str, body: str, tasks: int, *, round_: int) -> Batch:
        """Publish ``tasks`` while the worker is paused, resume it, time it, pause it again."""
        assert self.app_module is not None
        app_module = self.app_module
        worker = self.workers[variant]
        task = app_module.app.tasks[app_module.task_name(variant, body)]
        self._batches += 1
        batch = f"{self.id}-{self._batches}"
        worker.pause()
        meter = CpuMeter(worker.process.pid, self.redis)
        start = time.perf_counter()
        with app_module.app.producer_or_acquire() as producer:
            for i in range(tasks):
                task.apply_async((batch, i), queue=worker.queue, producer=producer)
        publish_rate = tasks / (time.perf_counter() - start)
        # After the publish: the publisher's own writes to Redis are not the worker's cost.
        before = meter.read()
        worker.resume()
        try:
            seconds = self._wait_done(worker, batch, tasks,
                                      batch_timeout(tasks, app_module.BODIES[body]))
            self._wait_quiet(worker, batch, tasks)
        finally:
            worker.pause()
        spent = CpuMeter.spent(before, meter.read())
        cpu_us = {part: cpu / tasks * 1e6 for part, cpu in spent.items()}
        return Batch(variant, body, round_, tasks, tasks / seconds, seconds, publish_rate,
                     cpu_us)

    def _wait_done(self, worker: Worker, batch: str, tasks: int, timeout: float) -> float:
        """Seconds from the batch's first task start to its last task end."""
        key = self.app_module.stats_key(batch) if self.app_module else ""
        deadline = time.monotonic() + timeout
        while True:
            figures = [tuple(map(float, v.split())) for v in self.redis.hgetall(key).values()]
            done = sum(int(f[0]) for f in figures)
            if done >= tasks:
                if done > tasks:
                    raise WorkerFailed(f"batch {batch}: {done} executions of {tasks} tasks "
                                       f"(redeliveries?):\n{worker.tail()}")
                return max(f[2] for f in figures) - min(f[1] for f in figures)
            if not worker.alive():
                raise WorkerFailed(f"worker {worker.variant} died mid-batch:\n{worker.tail()}")
            if time.monotonic() > deadline:
                raise WorkerFailed(f"batch {batch} ({worker.variant}): {done}/{tasks} tasks "
                                   f"after {timeout:.0f}s:\n{worker.tail()}")
            time.sleep(POLL)

    def _wait_quiet(self, worker: Worker, batch: str, tasks: int) -> None:
        """Before pausing the worker: every ack sent, and what each variant finishes after
        the body (lease settle confirmations, lock releases) landed. A lease still settling
        when its worker is paused past the settle deadline would be re-published by that
        worker's sweeper and run again inside a later batch."""
        deadline = time.monotonic() + QUIET_TIMEOUT
        pending = "?"
        while time.monotonic() < deadline:
            pending = self._pending(worker, batch, tasks)
            if not pending:
                return
            time.sleep(0.05)
        raise WorkerFailed(f"batch {batch} ({worker.variant}) did not settle within "
                           f"{QUIET_TIMEOUT}s: {pending}")

    def _pending(self, worker: Worker, batch: str, tasks: int) -> str:
        queued = self.redis.llen(f"{self.prefix}{worker.queue}")
        unacked = self.redis.hlen(f"{self.prefix}unacked")
        if queued or unacked:
            return f"{queued} queued, {unacked} unacked"
        if worker.variant in STORE_ENV:
            from lease_celery import LeaseState

            rows = self._store(worker.variant).find(prefix=f"bench:{batch}:", limit=tasks + 1)
            settled = sum(r.state is LeaseState.DONE and not r.settling for r in rows)
            if settled != tasks:
                return f"{settled}/{tasks} leases done and settled"
        locks = {"once": f"qo_*{batch}_*", "singleton": f"{self.prefix}singleton:*"}
        if worker.variant in locks:
            left = sum(1 for _ in self.redis.scan_iter(locks[worker.variant], count=1000))
            if left:
                return f"{left} locks not released"
        return ""

    def _store(self, variant: str) -> Any:
        """The harness's own connection to a variant's lease store, for looking at rows."""
        if variant not in self.stores:
            from lease_celery import open_store

            self.stores[variant] = open_store(self.env[STORE_ENV[variant]])
        return self.stores[variant]

    # -- clean-up ------------------------------------------------------------------------

    def stop_workers(self) -> None:
        """Warm shutdown of every worker at once (one by one would add their shutdowns up),
        within ``STOP_TIMEOUT`` in all; then every group is SIGKILLed in any case."""
        for worker in self.workers.values():
            worker.terminate()
        deadline = time.monotonic() + STOP_TIMEOUT
        for worker in self.workers.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                worker.process.wait(max(0.0, deadline - time.monotonic()))
        for worker in self.workers.values():
            worker.kill()

    def close(self) -> None:
        self.stop_workers()
        for store in self.stores.values():
            with contextlib.suppress(Exception):
                store.close()
        problems = []
        try:
            self._delete(self.redis, [f"{self.prefix}*", f"qo_*{self.id}-*"])
        except Exception as exc:  # clean up the rest all the same
            problems.append(f"broker keys: {exc}")
        if "redis" in self.variants:
            import redis

            try:
                with redis.Redis.from_url(self.store_redis_url, socket_timeout=10) as client:
                    self._delete(client, [f"{self.prefix}*"])
            except Exception as exc:
                problems.append(f"store keys: {exc}")
        if "mysql" in self.variants:
            try:
                _mysql_admin(f"DROP DATABASE IF EXISTS `{self.schema}`")
            except Exception as exc:
                problems.append(f"database {self.schema}: {exc}")
        if any(v.startswith("postgres") for v in self.variants):
            try:
                import psycopg

                with psycopg.connect(PG_DSN, autocommit=True, connect_timeout=5) as conn:
                    for schema in self.schemas:
                        conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
            except Exception as exc:
                problems.append(f"schemas {self.schemas}: {exc}")
        self.redis.close()
        if problems:
            print("clean-up incomplete: " + "; ".join(problems), file=sys.stderr)

    @staticmethod
    def _delete(client: Any, patterns: list[str]) -> None:
        for pattern in patterns:
            keys = list(client.scan_iter(pattern, count=1000))
            for start in range(0, len(keys), 500):
                client.delete(*keys[start:start + 500])


# -- the schedule --------------------------------------------------------------------------

def schedule(variants: list[str], round_: int) -> list[str]:
    """plain, v1, plain, v2, ..., plain; the others' order rotates with the round so that no
    variant always runs first or last."""
    others = [v for v in variants if v != "plain"]
    if others:
        shift = round_ % len(others)
        others = others[shift:] + others[:shift]
    order = ["plain"]
    for variant in others:
        order += [variant, "plain"]
    return order


def measure(run: Run, variants: list[str], bodies: list[str], tasks: dict[str, int],
            rounds: int, log: Any, started: float) -> tuple[list[Row], list[Batch]]:
    """Every round and body: plain, v1, plain, v2, ..., plain; returns the rows of the table
    and every batch. ``started``: the run's start (``time.monotonic``), for progress lines."""
    batches: list[Batch] = []
    rows = {(v, b): Row(v, b, tasks[b]) for b in bodies for v in variants}
    for round_ in range(rounds):
        for body in bodies:
            done: list[Batch] = []
            for variant in schedule(variants, round_):
                batch = run.batch(variant, body, tasks[body], round_=round_)
                done.append(batch)
                print(f"  [{time.monotonic() - started:6.1f}s] round {round_ + 1} {body:<5}"
                      f"{variant:<10}{batch.rate:>8,.0f} tasks/s in {batch.seconds:.2f}s",
                      file=log, flush=True)
            # Each variant against the mean of the plain batches just before and after it.
            for k, batch in enumerate(done):
                row = rows[batch.variant, body]
                if batch.variant != "plain":
                    around = (done[k - 1], done[k + 1])
                    batch.ratio = batch.rate / statistics.mean([b.rate for b in around])
                    batch.extra_worker_us = batch.cpu_us["worker"] - statistics.mean(
                        [b.cpu_us["worker"] for b in around])
                    row.ratios.append(batch.ratio)
                    row.extra_worker_us.append(batch.extra_worker_us)
                row.rates.append(batch.rate)
                row.publish_rates.append(batch.publish_rate)
                for part, value in batch.cpu_us.items():
                    row.cpu_us.setdefault(part, []).append(value)
            batches += done
    return list(rows.values()), batches


def table(rows: list[Row]) -> str:
    width = max([10, *(len(row.variant) + 2 for row in rows)])
    lines = [f"{'variant':<{width}}{'body':<6}{'tasks':>6}{'tasks/s':>10}{'ratio':>7}"
             f"{'publish/s':>11}{'worker':>9}{'main':>7}{'pool':>7}{'+worker':>9}{'redis':>7}"
             f"{'postgres':>9}{'mariadbd':>9}"
             "  ratios per round"]
    for row in rows:
        if row.ratio_median is None:
            # The baseline: show how far its own runs spread, to judge the noise.
            spread = (max(row.rates) - min(row.rates)) / row.rate_median
            ratio, detail = "1.00", f"baseline, {len(row.rates)} runs, spread {spread:.0%}"
            extra = "-"
        else:
            ratio, detail = f"{row.ratio_median:.2f}", " ".join(f"{r:.2f}" for r in row.ratios)
            extra = f"{row.extra_worker_median:+,.0f}"
        worker, redis, postgres, mariadbd = (row.cpu_median(part) for part in CPU_PARTS)
        # The main process (consumer, event loop, acks) apart from the pool processes (the
        # tasks): the main process's share follows the rate, the pool's is the task's own.
        main = row.cpu_median("worker_main")
        lines.append(f"{row.variant:<{width}}{row.body:<6}{row.tasks:>6}{row.rate_median:>10,.0f}"
                     f"{ratio:>7}{row.publish_median:>11,.0f}{worker:>9,.0f}{main:>7,.0f}"
                     f"{worker - main:>7,.0f}{extra:>9}{redis:>7,.0f}{postgres:>9,.0f}"
                     f"{mariadbd:>9,.0f}  {detail}")
    return "\n".join(lines)


# -- command line --------------------------------------------------------------------------

def parse_tasks(text: str, bodies: list[str]) -> dict[str, int]:
    """``N`` (every body) or ``noop=2000,10ms=500``."""
    if text.isdigit():
        counts = dict.fromkeys(bodies, int(text))
    else:
        counts = dict(DEFAULT_TASKS)
        for part in text.split(","):
            name, _, number = part.partition("=")
            if name not in DEFAULT_TASKS or not number.isdigit():
                raise argparse.ArgumentTypeError(f"--tasks: bad entry {part!r}")
            counts[name] = int(number)
    if any(counts[b] < 2 for b in bodies):
        raise argparse.ArgumentTypeError("--tasks: at least 2 tasks per batch")
    return {b: counts[b] for b in bodies}


def parse_list(text: str, known: tuple[str, ...], what: str) -> list[str]:
    items = [item for item in text.split(",") if item]
    unknown = [item for item in items if item not in known]
    if unknown or not items:
        raise argparse.ArgumentTypeError(f"--{what}: unknown {unknown}; known: {known}")
    return list(dict.fromkeys(items))


def check_servers(variants: list[str]) -> None:
    import redis

    try:
        redis.Redis(host=REDIS_HOST, port=REDIS_PORT, socket_connect_timeout=3).ping()
    except redis.RedisError as exc:
        raise SystemExit(f"Redis {REDIS_HOST}:{REDIS_PORT} is not reachable: {exc}") from exc
    if any(v.startswith("postgres") for v in variants):
        import psycopg

        try:
            psycopg.connect(PG_DSN, connect_timeout=3).close()
        except psycopg.Error as exc:
            raise SystemExit(f"PostgreSQL {PG_DSN} is not reachable: {exc}") from exc


def fs_type(path: Path) -> str:
    """The file system type of ``path`` from /proc/mounts (Linux; "" elsewhere)."""
    try:
        mounts = [line.split()[1:3] for line in Path("/proc/mounts").read_text().splitlines()]
    except OSError:
        return ""
    resolved, best = str(path.resolve()), ("", "")
    for point, kind in mounts:
        inside = resolved == point or resolved.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best[0]):
            best = (point, kind)
    return best[1]


class _Deadline(Exception):
    pass


@contextlib.contextmanager
def bounded(seconds: float) -> Iterator[None]:
    """The whole run within ``seconds``; SIGTERM and SIGALRM unwind through ``finally`` (so
    workers are killed and keys dropped) instead of ending the process on the spot."""
    def stop(signum: int, frame: FrameType | None) -> None:
        raise _Deadline(f"stopped by {signal.Signals(signum).name}")

    previous = signal.signal(signal.SIGALRM, stop), signal.signal(signal.SIGTERM, stop)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous[0])
        signal.signal(signal.SIGTERM, previous[1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                        help="comma-separated; plain is always run, as the baseline (also "
                             "known: " + ", ".join([*NO_HISTORY, *INLINE, *CARRIED, *BUSY])
                             + ")")
    parser.add_argument("--body", default="noop,10ms", help="comma-separated: noop, 10ms")
    parser.add_argument("--tasks", default="noop=2000,10ms=500",
                        help="tasks per batch: N for every body, or noop=N,10ms=M")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--loglevel", default="warning", help="the workers' -l")
    parser.add_argument("--tmp", type=Path,
                        help="folder for the SQLite file and the workers' cwd (default: the "
                             "system's temporary folder; on tmpfs, SQLite's fsync costs nothing)")
    parser.add_argument("--logs", type=Path, help="keep the workers' logs in this folder")
    parser.add_argument("--deadline", type=float, default=3600.0,
                        help="seconds for the whole run; then it stops and cleans up")
    args = parser.parse_args(argv)
    try:
        variants = parse_list(args.variants, VARIANTS, "variants")
        bodies = parse_list(args.body, tuple(DEFAULT_TASKS), "body")
        tasks = parse_tasks(args.tasks, bodies)
    except argparse.ArgumentTypeError as exc:
        parser.error(str(exc))
    if args.rounds < 1:
        parser.error("--rounds: at least 1")
    variants = ["plain", *[v for v in variants if v != "plain"]]
    check_servers(variants)
    started = time.monotonic()
    log = sys.stderr if args.json else sys.stdout
    with tempfile.TemporaryDirectory(prefix="bench-throughput-", dir=args.tmp) as tmp:
        if "sqlite" in variants and fs_type(Path(tmp)) == "tmpfs":
            print(f"warning: {tmp} is on tmpfs: the SQLite rows do not measure fsync",
                  file=sys.stderr)
        if args.logs:
            args.logs.mkdir(parents=True, exist_ok=True)
        run = Run(variants, Path(tmp), args.loglevel, args.logs)
        try:
            with bounded(args.deadline):
                run.load_app()
                print(f"run {run.id}: starting {len(variants)} workers", file=log, flush=True)
                run.start_workers()
                print(f"  workers ready and warm after {time.monotonic() - started:.1f}s",
                      file=log, flush=True)
                rows, batches = measure(run, variants, bodies, tasks, args.rounds, log,
                                        started)
                run.check_no_history()
        except (WorkerFailed, _Deadline) as exc:
            print(f"benchmark failed: {exc}", file=sys.stderr)
            return 1
        finally:
            # Bounded by itself (STOP_TIMEOUT, socket timeouts); a second SIGTERM must not cut
            # it short and leave workers, keys or the schema behind.
            previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
            try:
                run.close()
            finally:
                signal.signal(signal.SIGTERM, previous)
    elapsed = time.monotonic() - started
    if args.json:
        print(json.dumps({
            "run": run.id, "variants": variants, "bodies": bodies, "tasks": tasks,
            "rounds": args.rounds, "elapsed_s": round(elapsed, 1),
            "rows": [{**asdict(row), "rate_median": row.rate_median,
                      "ratio_median": row.ratio_median, "publish_median": row.publish_median,
                      "cpu_us_median": {part: row.cpu_median(part) for part in row.cpu_us},
                      "extra_worker_us_median": row.extra_worker_median}
                     for row in rows],
            "batches": [asdict(batch) for batch in batches],
        }, indent=2))
    else:
        print(table(rows))
        print(f"({elapsed:.0f}s; worker: prefork -c 2, prefetch 4, acks_late, ignore_result;"
              f" ratio: variant / mean of the plain runs before and after it; worker, redis,"
              f" postgres: CPU µs per task of those processes, the worker's split into its main"
              f" process and its pool processes; +worker: the worker's over the plain runs"
              f" around it)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
