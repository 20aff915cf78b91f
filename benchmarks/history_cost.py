"""What the history costs a claim + finish: the same store with and without it, per store.

The store writes each transition of a key into its history in the statement that makes it
(lease_celery.runtime.history): a trigger on SQLite and PostgreSQL, the script itself on Redis. This
measures what that costs the task's own path. Per store, two stores side by side in one run:

- *with*: a fresh store as lease_celery makes it;
- *without*: a fresh store whose history writes are taken out (the two triggers dropped; on
  Redis, the scripts registered with a ``record`` that returns at once).

Both get ``store.claim`` + ``store.finish`` on fresh keys (with task info, as a LeasedTask
claims) in bursts that alternate, the order flipping each round, so that machine noise hits
them alike. Prints µs per cycle (median over the bursts) and the difference, and what the
history takes per task: the two sides' storage after the same number of cycles (SQLite: the
vacuumed file; PostgreSQL: the tables with their indexes and TOAST; Redis: ``MEMORY USAGE``
of every key), its difference divided by the cycles. Keys are ``h:`` and 32 hex digits, the
owner ``bench``: a real owner (``host:pid:uuid/n``) adds its length twice per task.

    python benchmarks/history_cost.py [--cycles 400] [--rounds 8] [--stores sqlite,postgres,redis]

Needs PostgreSQL and Redis on 127.0.0.1 (the test servers) for those rows; each side removes
its own schema, file or keys.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from lease_celery import open_store
from lease_celery.stores.base import Store

PG_DSN = "postgresql://127.0.0.1:5432/test"
REDIS_URL = "redis://127.0.0.1:6379/13"
STORES = ("sqlite", "postgres", "redis")
TASK = {"options": {"task_id": "bench"}, "args": [], "kwargs": {}, "task": "bench.noop"}


def cycle_cost(store: Store, cycles: int) -> float:
    """µs per claim + finish on fresh keys, over ``cycles`` cycles."""
    started = time.perf_counter()
    for _ in range(cycles):
        lease = store.claim(f"h:{uuid.uuid4().hex}", owner="bench", ttl=30, task=TASK)
        assert lease is not None
        assert store.finish(lease, None)
    return (time.perf_counter() - started) / cycles * 1e6


#: A pair: the store with its history, the one without, and the storage of a side in bytes.
Pair = tuple[Store, Store, Callable[[str], int]]


@contextmanager
def sqlite_pair(tmp: Path) -> Iterator[Pair]:
    import sqlite3

    with_it = open_store(f"sqlite:///{tmp / 'with.sqlite3'}")
    without = open_store(f"sqlite:///{tmp / 'without.sqlite3'}")

    def size(side: str) -> int:
        path = tmp / f"{side}.sqlite3"
        conn = sqlite3.connect(path)
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        conn.execute("VACUUM")
        conn.close()
        return path.stat().st_size

    for store in (with_it, without):
        store.get("schema")  # the schema exists (and, on the second, its triggers)
    conn = sqlite3.connect(tmp / "without.sqlite3")
    conn.execute("DROP TRIGGER lease_celery_history_new_key")
    conn.execute("DROP TRIGGER lease_celery_history_transition")
    conn.commit()
    conn.close()
    try:
        yield with_it, without, size
    finally:
        with_it.close()
        without.close()


@contextmanager
def postgres_pair() -> Iterator[Pair]:
    import psycopg

    run = uuid.uuid4().hex[:8]
    schemas = {"with": f"bench_history_{run}_with", "without": f"bench_history_{run}_without"}
    stores = {side: open_store(f"{PG_DSN}?schema={schema}") for side, schema in schemas.items()}
    try:
        for store in stores.values():
            store.get("schema")
        with psycopg.connect(PG_DSN, autocommit=True) as conn:
            for trigger in ("lease_celery_history_new_key", "lease_celery_history_transition"):
                conn.execute(f'DROP TRIGGER {trigger} ON "{schemas["without"]}".'
                             f"lease_celery_leases")
        def size(side: str) -> int:
            with psycopg.connect(PG_DSN, autocommit=True) as conn:
                row = conn.execute(
                    "SELECT COALESCE(sum(pg_total_relation_size(c.oid)), 0) FROM pg_class c "
                    "JOIN pg_namespace n ON n.oid = c.relnamespace "
                    "WHERE n.nspname = %s AND c.relkind = 'r'", (schemas[side],)).fetchone()
            return int(row[0]) if row else 0

        yield stores["with"], stores["without"], size
    finally:
        for store in stores.values():
            store.close()
        with psycopg.connect(PG_DSN, autocommit=True) as conn:
            for schema in schemas.values():
                conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


@contextmanager
def redis_pair() -> Iterator[Pair]:
    import redis

    from lease_celery.stores.redis import lua

    run = uuid.uuid4().hex[:8]
    with_it = open_store(f"{REDIS_URL}?prefix=bench-history-{run}-with:")
    without = open_store(f"{REDIS_URL}?prefix=bench-history-{run}-without:")
    # The same scripts, with a history writer that writes nothing.
    head = "local function record(index, hash, t, event, owner, token, fence, detail)"
    prelude = lua.PRELUDE.replace(head, head + " do return end")
    client = without._client  # type: ignore[attr-defined]
    without._scripts = {  # type: ignore[attr-defined]
        name: client.register_script(f"{prelude}\n{body}")
        for name, body in lua.SCRIPTS.items()}
    cleaner = redis.Redis.from_url(REDIS_URL)

    def size(side: str) -> int:
        return sum(cleaner.memory_usage(key, samples=0) or 0
                   for key in cleaner.scan_iter(f"bench-history-{run}-{side}:*", count=1000))

    try:
        yield with_it, without, size
    finally:
        with_it.close()
        without.close()
        for side in ("with", "without"):
            keys = list(cleaner.scan_iter(f"bench-history-{run}-{side}:*", count=1000))
            for start in range(0, len(keys), 500):
                cleaner.delete(*keys[start:start + 500])
        cleaner.close()


WARM_UP = 50


def measure(pair: tuple[Store, Store], cycles: int, rounds: int) -> tuple[float, float]:
    """Median µs per cycle (with history, without), bursts alternating; each side makes
    ``WARM_UP + cycles * rounds`` cycles."""
    with_it, without = pair
    cycle_cost(with_it, WARM_UP)
    cycle_cost(without, WARM_UP)  # warm: connections, prepared statements, scripts
    costs: dict[str, list[float]] = {"with": [], "without": []}
    for round_ in range(rounds):
        order = ("with", "without") if round_ % 2 == 0 else ("without", "with")
        for side in order:
            costs[side].append(cycle_cost(with_it if side == "with" else without, cycles))
    return statistics.median(costs["with"]), statistics.median(costs["without"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=400, help="claim + finish cycles per burst")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--stores", default=",".join(STORES))
    args = parser.parse_args()
    wanted = [name.strip() for name in args.stores.split(",") if name.strip()]
    unknown = sorted(set(wanted) - set(STORES))
    if unknown:
        parser.error(f"unknown store(s) {', '.join(unknown)}: choose from {', '.join(STORES)}")
    with tempfile.TemporaryDirectory() as tmp:
        pairs: dict[str, Callable[[], object]] = {
            "sqlite": lambda: sqlite_pair(Path(tmp)), "postgres": postgres_pair,
            "redis": redis_pair}
        print(f"{'store':<10}{'with history µs':>17}{'without µs':>12}{'history µs':>12}"
              f"{'share':>8}{'history bytes/task':>20}")
        done = WARM_UP + args.cycles * args.rounds
        for name in wanted:
            with pairs[name]() as (with_store, without_store, size):  # type: ignore[attr-defined]
                with_it, without = measure((with_store, without_store), args.cycles,
                                           args.rounds)
                per_task = (size("with") - size("without")) / done
            print(f"{name:<10}{with_it:>17,.0f}{without:>12,.0f}{with_it - without:>12,.0f}"
                  f"{(with_it - without) / with_it:>8.0%}{per_task:>20,.0f}")
    print(f"(µs per claim + finish, median of {args.rounds} alternating bursts of "
          f"{args.cycles} cycles; history bytes per task after {done:,} cycles a side)")


if __name__ == "__main__":
    main()
