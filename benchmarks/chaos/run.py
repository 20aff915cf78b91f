"""One chaos run, start to verdict: sandbox, receiver, workers, publish + faults, settle, check.

Everything started is ended in reverse order whatever happens (an ``ExitStack``): faults are
undone (stopped processes continued, replies back to normal), worker groups stopped (SIGKILL
after a bounded wait), the receiver stopped, the store's schema or keys and the run's broker
keys deleted. The run directory (worker logs, ``history.json``, ``report.txt``) is kept when
the run failed or with ``--keep``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import shutil
import signal
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .appdb import AppDatabase
from .broker import BROKERS, BrokerSandbox, backend_url
from .checker import Report, check
from .config import APP_DB_VARIANTS, DJANGO_VARIANT, TX_VARIANTS, VARIANTS, ChaosConfig, job_key
from .djangodb import DjangoDatabase
from .events import EventLog
from .faults import FAULTS, OPT_IN, FaultInjector, parse_faults, plan_faults
from .flags import Flags
from .history import Published, collect
from .publish import Publisher, plan_publications
from .receiver import fetch_requests, running_receiver
from .report import format_report
from .sandbox import (
    BROKER_DB,
    MYSQL_HOST,
    MYSQL_PORT,
    PG_DSN,
    REDIS_HOST,
    REDIS_PORT,
    STORES,
    redis_client,
    store_sandbox,
)
from .storeserver import PERSISTENCE
from .txpublish import TxPublishers, plan_orders
from .workers import WorkerPool

__all__ = ["RunOptions", "main", "run"]

#: Seconds without any new event (and nothing queued) after which a run that has not settled
#: is judged stuck: longer than a sweep grace plus a ttl, so a late recovery still counts.
STALL = 20.0
#: Seconds of quiet (no new event) that end a settled run: callbacks and deferred copies done.
QUIET = 3.0
#: Seconds between the lines a settle that takes long prints on what it still waits for.
SAY_EVERY = 10.0
#: Publisher processes of the enqueue-tx variant.
PUBLISHERS = 2


class HarnessError(Exception):
    """The harness could not run (a server down, a worker that does not start)."""


@dataclass(frozen=True)
class RunOptions:
    store: str
    broker: str = "redis"
    tasks: int = 1000
    seconds: float | None = None  # the publishing (and fault) window
    faults: str = "all"
    seed: int | None = None
    settle: float = 90.0
    ttl: float = 2.0
    visibility_timeout: float = 3600.0
    workers: int = 3
    duplicates: float = 0.1  # fraction of jobs re-sent with the same id, and again as aliases
    record_at_publish: bool = False  # publish with lease_record=True (rows before messages)
    keep: bool = False
    extra_conf: dict[str, Any] = field(default_factory=dict)
    #: The Redis store on a redis-server of the run's own, with this persistence (``aof``,
    #: ``none``); None: on the machine's Redis, unless ``store-restart`` needs our own (aof).
    redis_persistence: str | None = None
    variant: str = "plain"  # config.VARIANTS

    @property
    def window(self) -> float:
        return self.seconds if self.seconds is not None else max(10.0, self.tasks / 15)


def _log(message: str) -> None:
    print(f"[chaos {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _check_servers(store: str, broker: BrokerSandbox) -> None:
    try:
        redis_client(BROKER_DB).ping()
    except Exception as exc:
        raise HarnessError(f"Redis at {REDIS_HOST}:{REDIS_PORT} is not reachable: {exc}") from exc
    try:
        broker.check()
    except Exception as exc:
        raise HarnessError(f"the {broker.kind} broker at {broker.url} is not reachable: "
                           f"{exc}") from exc
    if store == "postgres":
        import psycopg

        try:
            psycopg.connect(PG_DSN, connect_timeout=5).close()
        except Exception as exc:
            raise HarnessError(f"PostgreSQL at {PG_DSN} is not reachable: {exc}") from exc
    if store == "mysql":
        import pymysql

        try:
            pymysql.connect(host=MYSQL_HOST, port=MYSQL_PORT, user="root",
                            connect_timeout=5).close()
        except Exception as exc:
            raise HarnessError(f"MariaDB at {MYSQL_HOST}:{MYSQL_PORT} is not reachable: "
                               f"{exc}") from exc


def _check_variant(options: RunOptions) -> None:
    if options.variant not in VARIANTS:
        raise HarnessError(f"unknown variant {options.variant!r}; one of {', '.join(VARIANTS)}")
    if options.variant in TX_VARIANTS and options.store not in ("sqlite", "postgres"):
        raise HarnessError(f"the {options.variant} variant needs a SQL store (the app's "
                           "tables live in its database): --store sqlite or postgres")
    if options.variant == DJANGO_VARIANT and options.store != "postgres":
        raise HarnessError("the django-tx variant runs its Django project on PostgreSQL: "
                           "--store postgres")
    if options.variant == "enqueue-tx" and options.broker != "redis":
        raise HarnessError("the enqueue-tx variant purges the queue: --broker redis")


def _app_database(store_url: str) -> AppDatabase:
    """The app's tables, made in the store's database (the store makes its schema first)."""
    from lease_celery import open_store

    with open_store(store_url) as store:
        store.get("chaos:setup")
    app = AppDatabase.of(store_url)
    app.create_tables()
    return app


def _own_redis(options: RunOptions, kinds: list[str]) -> str | None:
    """The persistence of the run's own redis-server, or None for the machine's Redis."""
    if options.redis_persistence is not None and options.store != "redis":
        raise HarnessError("--redis-persistence applies to --store redis only")
    if options.store != "redis":
        return None
    if options.redis_persistence is not None:
        return options.redis_persistence
    # Never restart the machine's Redis: other test runs keep their databases there.
    return "aof" if "store-restart" in kinds else None


def client_app(config: ChaosConfig) -> Any:
    """The harness's Celery app: publishes by task name, reads the result backend."""
    from celery import Celery

    app = Celery("chaos-harness", set_as_current=False)
    app.conf.update(config.celery_conf())
    # The workers' extra settings too: a queue the publisher declares first must have the
    # workers' arguments (x-max-priority), and task_default_priority applies to its publishes.
    app.conf.update(config.extra_conf)
    return app


def settle(store_url: str, job_keys: set[str], events: EventLog, broker: BrokerSandbox, *,
           timeout: float) -> list[str]:
    """Wait until every key is done/dead and settled, nothing is queued and the log is quiet;
    return the keys still open when the deadline passed or the run stalled."""
    from lease_celery import LeaseState, open_store

    deadline = time.monotonic() + timeout
    length, changed = -1, time.monotonic()
    said = changed
    with open_store(store_url) as store:
        while True:
            now = time.monotonic()
            rows = store.find(limit=1_000_000)
            # A row still settling is not over: its outcome is not in the result backend yet
            # (its owner died after the finish, and a sweep's re-publish is to complete it).
            running = [r.key for r in rows
                       if r.state in (LeaseState.READY, LeaseState.RUNNING) or r.settling]
            jobs = {r.key: r.state for r in rows if r.key.startswith("job:")}
            unsettled = {k for k in job_keys if jobs.get(k) not in (LeaseState.DONE,
                                                                    LeaseState.DEAD)}
            open_keys = sorted(unsettled | set(running))
            queued = broker.queued()
            if events.length() != length:
                length, changed = events.length(), now
            if not open_keys and not queued and now - changed >= QUIET:
                return []
            if now - said >= SAY_EVERY:  # a slow settle says what it waits for
                said = now
                _log(f"waiting for {len(open_keys)} keys ({', '.join(open_keys[:5])}"
                     f"{' …' if len(open_keys) > 5 else ''}), {queued} messages queued")
            if now > deadline or (not queued and now - changed >= STALL):
                return open_keys
            time.sleep(1.0)


def run(options: RunOptions) -> tuple[Report, Path]:
    started = time.monotonic()
    if options.store not in STORES:
        raise HarnessError(f"unknown store {options.store!r}; one of {', '.join(STORES)}")
    _check_variant(options)
    kinds, skipped = parse_faults(options.faults, options.store, options.variant)
    own_redis = _own_redis(options, kinds)
    if ("store-restart" in kinds and options.store in ("postgres", "mysql")
            and os.environ.get("CI", "").lower() == "true"):
        # The machine's server is shared: a restart ends every other session on it, the CI
        # run's parallel tests included. Full runs only, by hand.
        raise HarnessError(f"store-restart on {options.store} restarts the machine's server: "
                           "not under CI=true")
    if options.broker not in BROKERS:
        raise HarnessError(f"unknown broker {options.broker!r}; one of {', '.join(BROKERS)}")
    run_id = uuid.uuid4().hex[:8]
    keyprefix = f"chaos_{run_id}:"
    try:
        broker = BrokerSandbox.of(options.broker, keyprefix, f"chaos-{run_id}")
    except RuntimeError as exc:
        raise HarnessError(str(exc)) from exc
    _check_servers(options.store, broker)
    seed = options.seed if options.seed is not None else random.randrange(2**32)
    rng = random.Random(seed)
    folder = Path(tempfile.mkdtemp(prefix=f"chaos-{options.store}-{run_id}-"))
    (folder / "flags").mkdir()
    events = EventLog(backend_url(), f"{keyprefix}events")
    flags = Flags(folder / "flags")
    notes = [f"broker {options.broker}; seed {seed}; faults {', '.join(kinds) or 'none'}; "
             f"run directory {folder}", *skipped]
    if options.record_at_publish:
        notes.append("published with lease_record=True (a row per key before its message)")
    if options.variant != "plain":
        notes.append(f"variant {options.variant}")
    if own_redis is not None:
        notes.append("the store on a redis-server of the run's own: " + (
            "appendonly yes, appendfsync always" if own_redis == "aof"
            else "no persistence (a restart loses every key)"))
    _log(f"run {run_id} on {options.store} ({options.broker} broker): {options.tasks} tasks "
         f"over {options.window:.0f}s, faults {', '.join(kinds) or 'none'}, seed {seed}")
    with contextlib.ExitStack() as stack:
        # Callbacks run last-registered first: broker keys go last, after everything stopped.
        stack.callback(broker.cleanup)
        sandbox = stack.enter_context(store_sandbox(options.store, run_id, folder,
                                                    own_redis=own_redis))
        receiver_url = stack.enter_context(running_receiver(folder))
        django = options.variant == DJANGO_VARIANT
        config = ChaosConfig(
            broker_url=broker.url, backend_url=backend_url(), keyprefix=keyprefix,
            queue=broker.queue,
            # django-tx: the store is Django's database (the workers' Django connects to it
            # through the proxy, under the run's tag), as a Django project configures it.
            store_url="django://default" if django else sandbox.worker_url,
            database_url=sandbox.worker_url if django else "",
            receiver_url=receiver_url,
            events_key=events.key, flags_dir=str(folder / "flags"), harness_pid=os.getpid(),
            ttl=options.ttl, heartbeat=options.ttl / 4, sweep_interval=options.ttl / 2,
            sweep_grace=3 * options.ttl, visibility_timeout=options.visibility_timeout,
            extra_conf=options.extra_conf, variant=options.variant)
        app_db: AppDatabase | DjangoDatabase | None = None
        if options.variant in APP_DB_VARIANTS:
            app_db = _app_database(sandbox.checker_url)
        elif django:
            app_db = DjangoDatabase(sandbox.checker_url)
            _log("migrating the run's Django database")
            try:
                app_db.migrate()
            except RuntimeError as exc:
                raise HarnessError(str(exc)) from exc
        pool = WorkerPool(config, folder, events, size=options.workers)
        stack.callback(pool.stop_all)
        _log(f"starting {options.workers} workers (logs in {folder})")
        try:
            pool.start()
        except RuntimeError as exc:
            raise HarnessError(str(exc)) from exc
        client = client_app(config)
        client.conf.lease_store_url = sandbox.checker_url  # the rows written at publish
        stack.callback(client.close)

        plan = plan_publications(options.tasks, options.window, rng,
                                 resend_fraction=options.duplicates,
                                 alias_fraction=options.duplicates)
        publisher: Publisher | TxPublishers
        if options.variant == "enqueue-tx":
            publisher = TxPublishers(config, plan_orders(options.tasks, options.window, rng),
                                     slots=PUBLISHERS, folder=folder, events=events,
                                     direct_store_url=sandbox.checker_url)
        else:
            publisher = Publisher(client, plan, record=options.record_at_publish)
        injector = FaultInjector(
            plan_faults(kinds, options.window, rng), window=options.window, pool=pool,
            sandbox=sandbox, flags=flags, events=events, rng=rng, ttl=options.ttl,
            finish_tickets=max(2, min(6, options.tasks // 100)), broker=broker)
        stack.callback(injector.stop)
        stack.callback(publisher.stop)
        _log(f"publishing {options.tasks} jobs; injecting faults")
        publisher.start()
        injector.start()
        publisher.join(options.window + 120)
        publisher.stop()
        deadline = time.monotonic() + options.window + 30
        while not injector.done() and time.monotonic() < deadline:
            time.sleep(0.2)
        injector.stop()
        if isinstance(publisher, TxPublishers):
            assert isinstance(app_db, AppDatabase)
            # What committed is what the database says: those are the jobs that must run.
            published = [Published(task_id, job, job_key(job), "original")
                         for job, task_id in sorted(app_db.read()[1].items())]
            notes += publisher.errors[:5]
        else:
            published = [Published(p.task_id, p.job, p.key, p.kind)
                         for p in publisher.published]
            notes += [f"publish error: {e}" for e in publisher.errors[:5]]
        _log("settling")
        open_keys = settle(sandbox.checker_url, {p.key for p in published}, events, broker,
                           timeout=options.settle)
        if open_keys:
            notes.append(f"{len(open_keys)} keys still open when the run ended (deadline or "
                         f"no progress for {STALL:.0f}s): {', '.join(open_keys[:10])}"
                         f"{' …' if len(open_keys) > 10 else ''}")
        notes += [f"fault error: {e}" for e in injector.errors[:5]]
        _log("stopping workers")
        pool.stop_all()
        if pool.restarts >= pool.max_restarts:
            notes.append(f"worker restarts reached their bound ({pool.max_restarts})")
        _log("collecting the history")
        history = collect(store=options.store, ttl=options.ttl, store_url=sandbox.checker_url,
                          client=client, broker=broker.messages(), published=published,
                          events=events.read(), received=fetch_requests(receiver_url),
                          notes=notes, wall_time=time.monotonic() - started,
                          variant=options.variant, linked=options.variant != "enqueue-tx",
                          app=app_db)
        history.save(folder / "history.json")
    report = check(history)
    (folder / "report.txt").write_text(format_report(report, shown=10**9) + "\n")
    if report.passed and not options.keep:
        shutil.rmtree(folder, ignore_errors=True)
    return report, folder


def _conf_value(text: str) -> tuple[str, Any]:
    name, sep, raw = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"--conf takes name=value, got {text!r}")
    for kind in (int, float):
        with contextlib.suppress(ValueError):
            return name, kind(raw)
    return name, {"true": True, "false": False}.get(raw.lower(), raw)


def parse_args(argv: list[str] | None) -> RunOptions:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.chaos",
        description="Run real workers under faults, then check the history they left.")
    parser.add_argument("--store", required=True, choices=STORES)
    parser.add_argument("--broker", choices=BROKERS, default="redis",
                        help="Redis (database 15), the machine's RabbitMQ, or SQS (a moto "
                             "server: LEASE_TEST_SQS_PORT, or one started for the run)")
    parser.add_argument("--tasks", type=int, default=1000, help="jobs to publish (CI: 200)")
    parser.add_argument("--seconds", type=float, default=None,
                        help="publishing and fault window (default: max(10, tasks/15))")
    parser.add_argument("--faults", default="all",
                        help=f"all, none, or a comma list of {','.join(FAULTS)} (and all), "
                             f"and the ones all leaves out: {','.join(OPT_IN)}")
    parser.add_argument("--seed", type=int, default=None, help="replay a plan (printed)")
    parser.add_argument("--settle", type=float, default=90.0,
                        help="seconds to wait for every key to settle after the window")
    parser.add_argument("--ttl", type=float, default=2.0, help="lease ttl (seconds)")
    parser.add_argument("--visibility-timeout", type=float, default=3600.0,
                        help="the Redis broker's visibility timeout (seconds)")
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--duplicates", type=float, default=0.1,
                        help="fraction of jobs re-sent with the same id (and as many aliases)")
    parser.add_argument("--keep", action="store_true", help="keep the run directory")
    parser.add_argument("--record-at-publish", action="store_true",
                        help="publish with lease_record=True: a row per key before its message")
    parser.add_argument("--redis-persistence", choices=PERSISTENCE, default=None,
                        help="the Redis store on a redis-server of the run's own (store-restart "
                             "starts one, aof by default): aof (appendonly yes, appendfsync "
                             "always) or none (a restart loses every key)")
    parser.add_argument("--variant", choices=VARIANTS, default="plain",
                        help="app-tx: bodies write an app row and complete in one transaction "
                             "of the app's connection; enqueue-tx: those jobs enqueued inside "
                             "publishers' transactions, half rolled back (SQL stores); "
                             "django-tx: bodies write Django models and complete in one "
                             "self.lease.atomic() block, store django://default (postgres)")
    parser.add_argument("--conf", type=_conf_value, action="append", default=[],
                        metavar="NAME=VALUE", help="an extra setting for the workers' app")
    args = parser.parse_args(argv)
    return RunOptions(store=args.store, broker=args.broker, tasks=args.tasks, seconds=args.seconds,
                      faults=args.faults, seed=args.seed, settle=args.settle, ttl=args.ttl,
                      visibility_timeout=args.visibility_timeout, workers=args.workers,
                      duplicates=args.duplicates, keep=args.keep, extra_conf=dict(args.conf),
                      record_at_publish=args.record_at_publish,
                      redis_persistence=args.redis_persistence, variant=args.variant)


def main(argv: list[str] | None = None) -> int:
    """Exit 0: every check passed; 1: a check failed; 2: the harness could not run."""
    options = parse_args(argv)
    # SIGTERM (a CI timeout) unwinds like an exception, so every cleanup step still runs.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        report, folder = run(options)
    except (HarnessError, ValueError) as exc:
        print(f"chaos: {exc}", file=sys.stderr)
        return 2
    print(format_report(report))
    if not report.passed:
        print(f"\nfull report, history and worker logs: {folder}")
    return 0 if report.passed else 1
