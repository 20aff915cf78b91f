"""What a LeasedTask costs the process that runs it, with and without the store's own work.

    python benchmarks/gate_cost.py [--stores canned,sqlite,postgres,redis] [--rounds 12]
        [--tasks 400] [--body-ms 0] [--finish auto|inline|background] [--waits] [--json]

Celery's own tracer (``celery.app.trace.build_tracer``, what a pool process runs for every
message) in a loop, in this one process, for a plain task and for a LeasedTask on each store,
in alternating bursts (the order rotating from round to round): CPU per task
(``time.process_time``) of each side, and each LeasedTask's CPU over the plain bursts around
it (the median over rounds).

``canned`` is the library's own path alone: a store whose claim and finish answer at once
from memory (``CannedStore``: no SQL, no socket, no fsync), so what it measures is the gate
(key, task info, the claim's bookkeeping, the heartbeat's, the signals, the finish's checks),
with no server to wait for. The real stores add their claim and finish, and what waiting for
a server costs the waiting process: the ``store part`` column (``store_part_us``) is that
alone, each round's real store over plain minus the canned store's of the same round. On the
virtual machines of 2026-12-06 the canned figure moved by up to 50 µs between runs (+183 and
+231 the same hour): compare sides of one run, or alternate runs of two builds.

The worker's figure (``worker_throughput.py``) adds the broker, the pool's messages and the
main process; this one is for telling whether a change to the library's own path pays.

``--body-ms 10``: every body (plain and leased alike) sleeps that long first, as a task that
waits on I/O does. The same path then costs more CPU where a process that slept comes back
to cold caches: the difference against ``--body-ms 0`` is that effect, not more work.
``--finish`` sets ``lease_finish_in_background`` (``auto``, the default, writes the finish of
a body of 2 ms or more on the heartbeat's sender thread: its hand-off is then in the figure).

``--waits`` adds what waiting itself costs the waiting process: the CPU per call of a request
the server answers at once against one it answers after 250 or 500 µs of its own (PostgreSQL
``SELECT pg_sleep(…)``, Redis a Lua script that loops on ``TIME``). Where a wait is not free
(a virtual machine whose every sleep and wake-up goes through its host), a store whose
statements take the server longer (a commit's WAL flush) costs the worker more CPU for the
same work, which no change to the library's Python can win back.
Needs PostgreSQL and Redis on 127.0.0.1 (the test servers) for those stores; each is cleaned
up after.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # run as a script, only benchmarks/ is on it

from celery import Celery  # noqa: E402
from celery.app.trace import build_tracer  # noqa: E402

from lease_celery import LeasedTask  # noqa: E402
from lease_celery.models import Lease  # noqa: E402
from lease_celery.stores.base import Clock, Row  # noqa: E402
from lease_celery.stores.registry import register_scheme  # noqa: E402
from lease_celery.stores.sqlite import SQLiteStore  # noqa: E402

PG_DSN = "postgresql://127.0.0.1:5432/test"
REDIS_URL = "redis://127.0.0.1:6379/14"
STORES = ("canned", "sqlite", "postgres", "redis")


class CannedStore(SQLiteStore):
    """``canned://``: claims and finishes (a finish carried by a claim too) answered at once
    from memory (every claim is a new token 1, every finish accepted); everything else is an
    in-memory SQLite store."""

    def __init__(self, url: str, *, clock: Clock | None = None) -> None:
        super().__init__("sqlite://", clock=clock)
        self.url = url

    def _claim(self, key: str, owner: str, ttl: float, task: str | None) -> Row | None:
        return {"token": 1, "expires_at": time.time() + ttl, "fence": 1, "attempts": 1,
                "takeovers": 0}

    def _finish(self, lease: Lease, result: str, settle_within: float | None) -> bool:
        return True

    def _finish_and_claim(self, finished: Lease, result: str, key: str, owner: str,
                          ttl: float, task: str | None) -> tuple[bool, Row | None]:
        return True, self._claim(key, owner, ttl, task)


register_scheme("canned", "benchmarks.gate_cost:CannedStore")


FINISH = {"auto": "auto", "inline": False, "background": True}


def _app(urls: dict[str, str], body_seconds: float = 0.0,
         finish: str = "auto") -> tuple[Celery, dict[str, Any]]:
    app = Celery("gate_cost", broker="memory://", backend="disabled://", set_as_current=False)
    # As the throughput benchmark's workers: results ignored, acks_late; no sweeper here.
    app.conf.update(task_ignore_result=True, task_acks_late=True, lease_sweep_interval=0,
                    lease_store_url=urls.get("canned", "canned://"),
                    lease_finish_in_background=FINISH[finish])
    tasks: dict[str, Any] = {}

    @app.task(name="gate.plain", shared=False)
    def plain(batch: str, i: int) -> None:
        if body_seconds:
            time.sleep(body_seconds)

    tasks["plain"] = plain
    for store, url in urls.items():
        @app.task(bind=True, base=LeasedTask, name=f"gate.{store}", shared=False,
                  lease_key="gate:{batch}:{i}", lease_store_url=url)
        def leased(self: LeasedTask, batch: str, i: int) -> None:
            if body_seconds:
                time.sleep(body_seconds)

        tasks[store] = leased
    app.finalize()
    return app, tasks


def _traced(app: Celery, task: Any) -> Callable[[str, int], Any]:
    """One delivery of ``task`` as a pool process runs it: a fresh task id per call."""
    tracer = build_tracer(task.name, task, app=app, eager=False, propagate=False)

    def deliver(batch: str, i: int) -> Any:
        task_id = uuid.uuid4().hex
        message = {"id": task_id, "task": task.name, "args": [batch, i], "kwargs": {},
                   "delivery_info": {"routing_key": "celery", "exchange": "", "priority": 0,
                                     "redelivered": False}, "hostname": "gate-cost"}
        return tracer(task_id, (batch, i), {}, message)

    return deliver


def _urls(stores: list[str], tmp: Path, run: str) -> dict[str, str]:
    known = {"canned": "canned://", "sqlite": f"sqlite:///{tmp / 'leases.sqlite3'}",
             "postgres": f"{PG_DSN}?schema=gate_{run}",
             "redis": f"{REDIS_URL}?prefix=gate_{run}:"}
    unknown = [store for store in stores if store not in known]
    if unknown:
        raise SystemExit(f"unknown store(s) {unknown}; known: {', '.join(STORES)}")
    return {store: known[store] for store in stores}


def measure(stores: list[str], *, rounds: int, tasks: int,
            body_seconds: float = 0.0, finish: str = "auto") -> dict[str, Any]:
    run = uuid.uuid4().hex[:8]
    with tempfile.TemporaryDirectory(prefix="gate-cost-") as tmp:
        urls = _urls(stores, Path(tmp), run)
        app, registered = _app(urls, body_seconds, finish)
        sides = {name: _traced(app, task) for name, task in registered.items()}
        batch, counter = uuid.uuid4().hex[:8], itertools.count()
        for deliver in sides.values():  # warm up: connections, schemas, first imports
            for _ in range(100):
                deliver(batch, next(counter))
        cpu: dict[str, list[float]] = {name: [] for name in sides}
        extra: dict[str, list[float]] = {store: [] for store in stores}
        try:
            for round_no in range(rounds):
                order = stores[round_no % len(stores):] + stores[:round_no % len(stores)]
                before = _burst(sides["plain"], batch, counter, tasks)
                cpu["plain"].append(before)
                for store in order:
                    leased = _burst(sides[store], batch, counter, tasks)
                    after = _burst(sides["plain"], batch, counter, tasks)
                    cpu[store].append(leased)
                    cpu["plain"].append(after)
                    extra[store].append(leased - (before + after) / 2)
                    before = after
        finally:
            _clean_up(urls, run)
    # A real store's part: its LeasedTask's CPU over plain minus the canned store's of the
    # same round (the library's path alone), round by round, so that both share the round's
    # machine: what the store's client, its commit and the wait for it cost this process.
    part = {store: [own - canned for own, canned in zip(extra[store], extra["canned"],
                                                        strict=True)]
            for store in stores if store != "canned" and "canned" in stores}
    return {"rounds": rounds, "tasks": tasks, "body_ms": body_seconds * 1000, "finish": finish,
            "cpu_us": {name: statistics.median(values) for name, values in cpu.items()},
            "extra_us": {store: statistics.median(values) for store, values in extra.items()},
            "extra_spread_us": {store: max(values) - min(values)
                                for store, values in extra.items()},
            "store_part_us": {store: statistics.median(values) for store, values in part.items()}}


#: Server-side delays (µs) ``--waits`` measures, and the calls per burst.
WAIT_DELAYS = (0, 250, 500)
WAIT_CALLS = 300


def measure_waits(*, rounds: int) -> dict[str, dict[int, float]]:
    """Client CPU µs per call, per server and server-side delay (medians over ``rounds``
    alternating bursts)."""
    import psycopg
    import redis

    client = redis.Redis.from_url(REDIS_URL)
    busy = client.register_script(
        "local t = redis.call('TIME') local start = t[1] * 1000000 + t[2] "
        "repeat t = redis.call('TIME') until t[1] * 1000000 + t[2] - start >= "
        "tonumber(ARGV[1]) return 1")
    conn = psycopg.connect(PG_DSN, autocommit=True)
    calls: dict[str, Callable[[int], Any]] = {
        "postgres": lambda delay: conn.execute("SELECT pg_sleep(%s)",
                                               (delay / 1e6,)).fetchone(),
        "redis": lambda delay: busy(args=[delay])}
    figures: dict[str, dict[int, list[float]]] = {
        server: {delay: [] for delay in WAIT_DELAYS} for server in calls}
    try:
        for _ in range(rounds):
            for server, call in calls.items():
                for delay in WAIT_DELAYS:
                    started = time.process_time()
                    for _ in range(WAIT_CALLS):
                        call(delay)
                    figures[server][delay].append(
                        (time.process_time() - started) / WAIT_CALLS * 1e6)
    finally:
        conn.close()
        client.close()
    return {server: {delay: statistics.median(values) for delay, values in by_delay.items()}
            for server, by_delay in figures.items()}


def _burst(deliver: Callable[[str, int], Any], batch: str, counter: Any, tasks: int) -> float:
    started = time.process_time()
    for _ in range(tasks):
        deliver(batch, next(counter))
    return (time.process_time() - started) / tasks * 1e6


def _clean_up(urls: dict[str, str], run: str) -> None:
    from lease_celery.runtime.heartbeat import Heartbeat
    from lease_celery.stores.registry import shared_store

    # The last finishes behind the return wait for a claim that will not come: written now,
    # before the stores close (a write after the drop below would make the schema again).
    Heartbeat.for_process().writes.flush(5.0)
    for url in urls.values():
        shared_store(url).close()
    if "postgres" in urls:
        import psycopg

        with psycopg.connect(PG_DSN, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "gate_{run}" CASCADE')
    if "redis" in urls:
        import redis

        client = redis.Redis.from_url(REDIS_URL)
        keys = list(client.scan_iter(match=f"gate_{run}:*", count=1000))
        if keys:
            client.delete(*keys)
        client.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stores", default=",".join(STORES))
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--tasks", type=int, default=400, help="tasks per burst")
    parser.add_argument("--body-ms", type=float, default=0.0,
                        help="every body sleeps this long (ms) first")
    parser.add_argument("--finish", choices=sorted(FINISH), default="auto",
                        help="lease_finish_in_background: auto, inline (False), background (True)")
    parser.add_argument("--waits", action="store_true",
                        help="also: the client CPU of a call the server answers late")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    stores = [store for store in args.stores.split(",") if store]
    result = measure(stores, rounds=args.rounds, tasks=args.tasks,
                     body_seconds=args.body_ms / 1000, finish=args.finish)
    if args.waits:
        result["waits_us"] = measure_waits(rounds=max(3, args.rounds // 2))
    if args.json:
        print(json.dumps(result))
        return 0
    parts = result["store_part_us"]
    print(f"{'side':<10} {'CPU µs/task':>12} {'over plain':>11} {'spread':>8} "
          f"{'store part':>11}")
    print(f"{'plain':<10} {result['cpu_us']['plain']:>12,.0f} {'-':>11} {'-':>8} {'-':>11}")
    for store in stores:
        part = f"{parts[store]:>+11,.0f}" if store in parts else f"{'-':>11}"
        print(f"{store:<10} {result['cpu_us'][store]:>12,.0f} "
              f"{result['extra_us'][store]:>+11,.0f} {result['extra_spread_us'][store]:>8,.0f} "
              f"{part}")
    body = (f"{args.body_ms:g} ms bodies" if args.body_ms else "no-op bodies") + (
        f", finish {args.finish}")
    print(f"({args.rounds} rounds of {args.tasks} tasks per side, alternating, {body}; Celery's "
          "tracer in one process, ignore_result; over plain: the median over rounds of the "
          "LeasedTask's CPU minus the plain bursts around it; spread: its max - min; store part: "
          "that minus the canned store's of the same round, the median over rounds: what the "
          "store's client, its commit and the wait for it cost this process)")
    if args.waits:
        print()
        print(f"{'server':<10} " + " ".join(f"{f'answers in {d} µs':>17}" for d in WAIT_DELAYS))
        for server, by_delay in result["waits_us"].items():
            print(f"{server:<10} " + " ".join(f"{by_delay[d]:>17,.0f}" for d in WAIT_DELAYS))
        print("(client CPU µs per call, this process: the server's own time is not in it)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
