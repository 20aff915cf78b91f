"""The Celery app the throughput workers run: ``celery -A benchmarks.worker_throughput_app worker``.

One module holds every variant's tasks (``bench.<variant>.<body>``), so every worker runs the
same Celery configuration and the same bodies; only the base class differs:

- ``plain``: a plain Celery task (the baseline);
- ``plain-busy``: the same, its body first spending some CPU in a busy loop (``BUSY``);
- ``sqlite``, ``postgres``, ``redis``, ``mysql``: ``LeasedTask`` keyed ``bench:{batch}:{i}``
  on that store;
- ``once``: celery-once's ``QueueOnce`` (its Redis backend), keyed on both arguments;
- ``singleton``: celery-singleton's ``Singleton`` (its Redis backend), keyed on both arguments.

Every task gets a distinct key (``batch`` is fresh for every batch, ``i`` runs over it), so no
variant ever deduplicates anything: what is measured is the price of the bookkeeping.

Configured from the environment that ``benchmarks/worker_throughput.py`` sets (``BENCH_*``).
``BENCH_VARIANTS`` names the variants whose tasks this process registers: a worker registers
only its own, because ``lease_celery`` opens (at worker start) and sweeps (every few seconds,
from the worker's main process) the store of *every* LeasedTask the app has, and the plain
worker must not be sweeping the SQLite file the sqlite worker is writing to.

Timing is taken inside the pool processes: ``task_prerun`` / ``task_postrun`` note the first
start and the last end of each batch in memory, and a thread in each pool process copies those
figures to Redis every ``FLUSH_INTERVAL`` (one small write, not one per task, so the
measurement costs every variant the same and almost nothing).
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

import redis
from celery import Celery, Task
from celery import signals as celery_signals

from benchmarks.worker_variants import BUSY, CARRIED, INLINE, VARIANTS

__all__ = ["BODIES", "VARIANTS", "app", "stats_key", "task_name"]

#: Body name -> seconds the body sleeps (0: returns at once).
BODIES = {"noop": 0.0, "10ms": 0.01}
#: Seconds between two copies of a pool process's figures to Redis.
FLUSH_INTERVAL = 0.02
#: Seconds a celery-once / celery-singleton lock lives if a run dies before releasing it.
LOCK_EXPIRY = 3600

ENV = os.environ
#: Every Redis key of the run (broker, locks, timings) starts with this prefix.
PREFIX = ENV.get("BENCH_PREFIX", "bench_unset:")
BROKER_URL = ENV.get("BENCH_BROKER", "redis://127.0.0.1:6379/9")
STORE_URLS = {"sqlite": ENV.get("BENCH_SQLITE_URL", ""),
              "postgres": ENV.get("BENCH_POSTGRES_URL", ""),
              "redis": ENV.get("BENCH_REDIS_STORE_URL", ""),
              "mysql": ENV.get("BENCH_MYSQL_URL", ""),
              # The same stores with the history triggers dropped after the warm-up (what the
              # history costs a task: see worker_throughput.py).
              "sqlite-nohistory": ENV.get("BENCH_SQLITE_NOHISTORY_URL", ""),
              "postgres-nohistory": ENV.get("BENCH_POSTGRES_NOHISTORY_URL", "")}
REGISTERED = [v for v in ENV.get("BENCH_VARIANTS", "plain").split(",") if v]


def task_name(variant: str, body: str) -> str:
    return f"bench.{variant}.{body}"


def stats_key(batch: str) -> str:
    """The Redis hash of a batch's timings: one field per pool process, "count first last"."""
    return f"{PREFIX}stats:{batch}"


app = Celery("bench_throughput", broker=BROKER_URL)
#: Extra lease_* settings for a run, as JSON (e.g. '{"lease_finish_in_background": true}'):
#: what a knob costs, measured by the same harness.
LEASE_CONF = json.loads(ENV.get("BENCH_LEASE_CONF") or "{}")

app.conf.update(
    task_acks_late=True,
    # The setting lease_celery asks for with acks_late; on for every variant alike.
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=4,
    task_ignore_result=True,
    result_backend=None,
    # Everything kombu writes (queues, the unacked hash, bindings) goes under the run's
    # prefix, so the run deletes exactly its own keys and never meets another run's.
    broker_transport_options={"global_keyprefix": PREFIX},
    broker_connection_retry_on_startup=True,
    # No control commands are used (the harness pauses workers with signals): no pidbox.
    worker_enable_remote_control=False,
    worker_send_task_events=False,
    # celery-once: its Redis backend, on the broker's server as it would be deployed.
    ONCE={"backend": "celery_once.backends.Redis",
          "settings": {"url": BROKER_URL, "default_timeout": LOCK_EXPIRY}},
    # celery-singleton: likewise, under the run's prefix.
    singleton_backend_url=BROKER_URL,
    singleton_key_prefix=f"{PREFIX}singleton:",
    singleton_lock_expiry=LOCK_EXPIRY,
    **LEASE_CONF,
)


def _body(seconds: float, busy_us: int = 0) -> Any:
    if busy_us:
        def body(batch: str, i: int) -> None:
            # CPU, not wall time: a busy loop until the process has spent busy_us.
            until = time.process_time() + busy_us / 1e6
            while time.process_time() < until:
                pass
            if seconds:
                time.sleep(seconds)
    elif seconds:
        def body(batch: str, i: int) -> None:
            time.sleep(seconds)
    else:
        def body(batch: str, i: int) -> None:
            return None
    return body


def _base_and_options(variant: str) -> tuple[type[Task], dict[str, Any]]:
    """The task base class of a variant and its options; imports only what it needs, so the
    optional packages (celery-once, celery-singleton) are needed only to run their variant."""
    if variant == "plain" or variant in BUSY:
        return app.Task, {}
    if variant in CARRIED:
        from lease_celery import settings as lease_settings

        # A worker registers one variant's tasks (BENCH_VARIANTS): only this worker is changed.
        if [variant] == REGISTERED:
            lease_settings.BACKGROUND_AFTER = float("inf")
        return _base_and_options(CARRIED[variant])
    if variant in INLINE:
        base, options = _base_and_options(INLINE[variant])
        return base, {**options, "lease_finish_in_background": False}
    if variant in STORE_URLS:
        from lease_celery import LeasedTask

        if not STORE_URLS[variant]:
            raise RuntimeError(f"no store URL for the {variant} variant in the environment")
        return LeasedTask, {"lease_key": "bench:{batch}:{i}",
                            "lease_store_url": STORE_URLS[variant]}
    if variant == "once":
        from celery_once import QueueOnce

        # graceful=False: a duplicate would raise at publish, so a run that deduplicated
        # anything fails loudly instead of reporting a rate for fewer tasks.
        return QueueOnce, {"once": {"graceful": False}}
    if variant == "singleton":
        from celery_singleton import Singleton

        return Singleton, {"raise_on_duplicate": True}
    raise ValueError(f"unknown variant {variant!r}; known: {', '.join(VARIANTS)}")


for _variant in REGISTERED:
    _base, _options = _base_and_options(_variant)
    for _body_name, _seconds in BODIES.items():
        app.task(base=_base, name=task_name(_variant, _body_name), **_options)(
            _body(_seconds, BUSY.get(_variant, 0)))


# -- timing, in the pool processes ---------------------------------------------------------

class _Timings:
    """Per batch: tasks ended, first start, last end (``time.monotonic``, which on Linux is
    CLOCK_MONOTONIC and so comparable between the processes of one machine)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.batches: dict[str, list[float]] = {}
        self.dirty: set[str] = set()

    def started(self, batch: str) -> None:
        now = time.monotonic()
        with self.lock:
            if batch not in self.batches:
                self.batches[batch] = [0, now, now]

    def ended(self, batch: str) -> None:
        now = time.monotonic()
        with self.lock:
            figures = self.batches.setdefault(batch, [0, now, now])
            figures[0] += 1
            figures[2] = now
            self.dirty.add(batch)

    def flush_forever(self, client: redis.Redis) -> None:
        pid = str(os.getpid())
        while True:
            time.sleep(FLUSH_INTERVAL)
            with self.lock:
                dirty = {b: list(self.batches[b]) for b in self.dirty}
                self.dirty.clear()
            if not dirty:
                continue
            try:
                with client.pipeline(transaction=False) as pipe:
                    for batch, (count, first, last) in dirty.items():
                        pipe.hset(stats_key(batch), pid, f"{int(count)} {first!r} {last!r}")
                    pipe.execute()
            except redis.RedisError:
                with self.lock:  # try again next time rather than lose the last figures
                    self.dirty.update(dirty)


_timings = _Timings()


def _batch_of(args: Any) -> str | None:
    return str(args[0]) if args else None


def _on_prerun(args: Any = None, **_: Any) -> None:
    batch = _batch_of(args)
    if batch is not None:
        _timings.started(batch)


def _on_postrun(args: Any = None, **_: Any) -> None:
    batch = _batch_of(args)
    if batch is not None:
        _timings.ended(batch)


def _start_flusher(**_: Any) -> None:
    # In the pool process, after fork: a connection and a thread of its own.
    client = redis.Redis.from_url(BROKER_URL, socket_timeout=5, socket_connect_timeout=5)
    threading.Thread(target=_timings.flush_forever, args=(client,), name="bench-flush",
                     daemon=True).start()


def _announce_ready(sender: Any = None, **_: Any) -> None:
    hostname = getattr(sender, "hostname", "?")
    client = redis.Redis.from_url(BROKER_URL, socket_timeout=5, socket_connect_timeout=5)
    client.set(f"{PREFIX}ready:{hostname}", str(os.getpid()), ex=LOCK_EXPIRY)
    client.close()


# (connected by call: celery's decorators are untyped)
celery_signals.task_prerun.connect(_on_prerun, weak=False)
celery_signals.task_postrun.connect(_on_postrun, weak=False)
celery_signals.worker_process_init.connect(_start_flusher, weak=False)
celery_signals.worker_ready.connect(_announce_ready, weak=False)


# -- profiling (BENCH_PROFILE=<folder>: a cProfile of each pool process, for finding costs) --

def _start_profile(**_: Any) -> None:
    import cProfile

    # CPU time of the thread the tasks run in, not wall time: waits on a socket cost nothing.
    profile = cProfile.Profile(time.thread_time)
    folder = ENV["BENCH_PROFILE"]

    def dump(**_: Any) -> None:
        profile.disable()
        profile.dump_stats(os.path.join(folder, f"pool-{os.getpid()}.prof"))

    celery_signals.worker_process_shutdown.connect(dump, weak=False)
    profile.enable()


if ENV.get("BENCH_PROFILE"):
    celery_signals.worker_process_init.connect(_start_profile, weak=False)
