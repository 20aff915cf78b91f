"""What the history costs a claim + finish: the same store with and without it, per store.

The store writes each transition of a key into its history in the statement that makes it
(lease_celery.history): a trigger on SQLite and PostgreSQL, the script itself on Redis. This
measures what that costs the task's own path. Per store, two stores side by side in one run:

- *with*: a fresh store as lease_celery makes it;
- *without*: a fresh store whose history writes are taken out (the two triggers dropped; on
  Redis, the scripts registered with a ``record`` that returns at once).

Both get ``store.claim`` + ``store.finish`` on fresh keys (with task info, as a LeasedTask
claims) in bursts that alternate, the order flipping each round, so that machine noise hits
them alike. Prints µs per cycle (median over the bursts) and the difference.

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


@contextmanager
def sqlite_pair(tmp: Path) -> Iterator[tuple[Store, Store]]:
    import sqlite3

    with_it = open_store(f"sqlite:///{tmp / 'with.sqlite3'}")
    without = open_store(f"sqlite:///{tmp / 'without.sqlite3'}")
    for store in (with_it, without):
        store.get("schema")  # the schema exists (and, on the second, its triggers)
    conn = sqlite3.connect(tmp / "without.sqlite3")
    conn.execute("DROP TRIGGER lease_celery_history_new_key")
    conn.execute("DROP TRIGGER lease_celery_history_transition")
    conn.commit()
    conn.close()
    try:
        yield with_it, without
    finally:
        with_it.close()
        without.close()


@contextmanager
def postgres_pair() -> Iterator[tuple[Store, Store]]:
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
        yield stores["with"], stores["without"]
    finally:
        for store in stores.values():
            store.close()
        with psycopg.connect(PG_DSN, autocommit=True) as conn:
            for schema in schemas.values():
                conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


@contextmanager
def redis_pair() -> Iterator[tuple[Store, Store]]:
    import redis

    from lease_celery.stores import redis as redis_store

    run = uuid.uuid4().hex[:8]
    with_it = open_store(f"{REDIS_URL}?prefix=bench-history-{run}-with:")
    without = open_store(f"{REDIS_URL}?prefix=bench-history-{run}-without:")
    # The same scripts, with a history writer that writes nothing.
    head = "local function record(index, hash, t, event, owner, token, fence, detail)"
    prelude = redis_store._PRELUDE.replace(head, head + " do return end")
    client = without._client  # type: ignore[attr-defined]
    without._scripts = {  # type: ignore[attr-defined]
        name: client.register_script(f"{prelude}\n{body}")
        for name, body in redis_store._SCRIPTS.items() if name != "clock"}
    try:
        yield with_it, without
    finally:
        with_it.close()
        without.close()
        cleaner = redis.Redis.from_url(REDIS_URL)
        for side in ("with", "without"):
            keys = list(cleaner.scan_iter(f"bench-history-{run}-{side}:*", count=1000))
            for start in range(0, len(keys), 500):
                cleaner.delete(*keys[start:start + 500])
        cleaner.close()


def measure(pair: tuple[Store, Store], cycles: int, rounds: int) -> tuple[float, float]:
    """Median µs per cycle (with history, without), bursts alternating."""
    with_it, without = pair
    cycle_cost(with_it, 50)
    cycle_cost(without, 50)  # warm: connections, prepared statements, scripts
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
              f"{'share':>8}")
        for name in wanted:
            with pairs[name]() as pair:  # type: ignore[attr-defined]
                with_it, without = measure(pair, args.cycles, args.rounds)
            print(f"{name:<10}{with_it:>17,.0f}{without:>12,.0f}{with_it - without:>12,.0f}"
                  f"{(with_it - without) / with_it:>8.0%}")
    print(f"(µs per claim + finish, median of {args.rounds} alternating bursts of "
          f"{args.cycles} cycles)")


if __name__ == "__main__":
    main()
