"""Claim + finish cycles per second: through lease_celery, and with the raw driver alone.

For each store the same two statements (the library's own SQL / Lua, read from its files) are
issued in the same run, in alternating rounds so that machine noise hits both sides alike:

    python benchmarks/store_cycle.py [--seconds 0.25] [--rounds 24] [--stores sqlite,postgres,redis]

Prints cycles/s for each side (mean over the bursts) and the ratio library / raw. Needs
PostgreSQL and Redis on 127.0.0.1 (the test servers) for those rows.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sqlite3
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lease_celery import open_store
from lease_celery.stores.queries import load_queries

PG_DSN = "postgresql://127.0.0.1:5432/test"
REDIS_URL = "redis://127.0.0.1:6379/14"
RESULT = {"pages": 3, "ok": True}
TTL = 30.0


_fresh = itertools.count()


def rate(cycle: Callable[[int], None], seconds: float) -> float:
    """Run ``cycle(i)`` on fresh keys for ``seconds``; return cycles per second."""
    count, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        cycle(next(_fresh))
        count += 1
    return count / elapsed


def library_cycle(url: str) -> tuple[Callable[[int], None], Callable[[], None]]:
    store = open_store(url)
    run = uuid.uuid4().hex[:8]

    def cycle(i: int) -> None:
        lease = store.claim(f"lib:{run}:{i}", owner="bench", ttl=TTL)
        assert lease is not None and store.finish(lease, RESULT)

    return cycle, store.close


def raw_sqlite(path: str) -> tuple[Callable[[int], None], Callable[[], None]]:
    q = load_queries("sqlite")
    conn = sqlite3.connect(path, isolation_level=None, timeout=10)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=FULL")
    run = uuid.uuid4().hex[:8]

    def cycle(i: int) -> None:
        key = f"raw:{run}:{i}"
        conn.execute("BEGIN IMMEDIATE")
        now = time.time()
        token, *_ = conn.execute(q["claim"], {"key": key, "owner": "bench", "now": now,
                                              "expires_at": now + TTL, "task": None}).fetchone()
        conn.execute(q["bump_fence"])
        conn.execute("COMMIT")
        conn.execute("BEGIN IMMEDIATE")
        cur = conn.execute(q["finish"], {"key": key, "owner": "bench", "token": token,
                                         "now": time.time(), "result": json.dumps(RESULT),
                                         "settle_deadline": None})
        assert cur.rowcount == 1
        conn.execute("COMMIT")

    return cycle, conn.close


def raw_postgres(url: str) -> tuple[Callable[[int], None], Callable[[], None]]:
    import psycopg

    schema = url.split("schema=")[1]
    q = {name: sql.replace("{schema}", f'"{schema}"')
         for name, sql in load_queries("postgres").items()}
    conn = psycopg.connect(PG_DSN, autocommit=True)
    run = uuid.uuid4().hex[:8]

    def cycle(i: int) -> None:
        key = f"raw:{run}:{i}"
        row = conn.execute(q["claim"], {"key": key, "owner": "bench", "ttl": TTL, "now": None,
                                        "task": None, "nonce": uuid.uuid4().hex}).fetchone()
        assert row is not None
        done = conn.execute(q["finish"], {"key": key, "owner": "bench", "token": row[0],
                                          "now": None, "result": json.dumps(RESULT),
                                          "settle_within": None}).fetchone()
        assert done is not None

    return cycle, conn.close


def raw_redis(url: str) -> tuple[Callable[[int], None], Callable[[], None]]:
    import redis

    scripts = load_queries("redis", ".lua")
    client = redis.Redis.from_url(REDIS_URL, decode_responses=True)
    claim = client.register_script(scripts["clock"] + "\n" + scripts["claim"])
    finish = client.register_script(scripts["clock"] + "\n" + scripts["fenced_write"])
    prefix = url.split("prefix=")[1]
    run = uuid.uuid4().hex[:8]

    def cycle(i: int) -> None:
        keys = [f"{prefix}lease:raw:{run}:{i}", f"{prefix}token:raw:{run}:{i}", f"{prefix}fence",
                f"{prefix}running"]
        token, *_ = claim(keys=keys, args=["", "bench", repr(TTL), "", uuid.uuid4().hex])
        assert finish(keys=[keys[0], keys[3]], args=["", "bench", token, "done",
                                                     json.dumps(RESULT), "", "0.0", ""])

    return cycle, client.close


def measure(name: str, url: str, raw: Callable[[str], Any], seconds: float,
            rounds: int) -> dict[str, Any]:
    lib_cycle, lib_close = library_cycle(url)
    raw_cycle, raw_close = raw(url.removeprefix("sqlite:///") if name == "sqlite" else url)
    lib_cycle(-1), raw_cycle(-1)  # warm up: connect, create schema, load scripts
    # Many short alternating bursts: a slow patch of the machine (fsync stalls, the other
    # core busy) lands on both sides instead of deciding the ratio.
    lib_rates, raw_rates = [], []
    for _ in range(rounds):
        lib_rates.append(rate(lib_cycle, seconds))
        raw_rates.append(rate(raw_cycle, seconds))
    lib_close(), raw_close()
    lib, raw_rate = statistics.mean(lib_rates), statistics.mean(raw_rates)
    return {"store": name, "library": lib, "raw": raw_rate, "ratio": lib / raw_rate}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=0.25, help="per burst and side")
    parser.add_argument("--rounds", type=int, default=24)
    parser.add_argument("--stores", default="sqlite,postgres,redis")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        schema = f"bench_{uuid.uuid4().hex[:8]}"
        prefix = f"bench_{uuid.uuid4().hex[:8]}:"
        targets = {
            "sqlite": (f"sqlite:///{Path(tmp) / 'bench.sqlite3'}", raw_sqlite),
            "postgres": (f"{PG_DSN}?schema={schema}", raw_postgres),
            "redis": (f"{REDIS_URL}?prefix={prefix}", raw_redis),
        }
        try:
            for name in args.stores.split(","):
                url, raw = targets[name]
                rows.append(measure(name, url, raw, args.seconds, args.rounds))
        finally:
            cleanup(schema, prefix, args.stores)
    print(f"{'store':<10}{'library cycles/s':>18}{'raw cycles/s':>14}{'ratio':>8}")
    for row in rows:
        print(f"{row['store']:<10}{row['library']:>18,.0f}{row['raw']:>14,.0f}"
              f"{row['ratio']:>8.2f}")


def cleanup(schema: str, prefix: str, stores: str) -> None:
    if "postgres" in stores:
        import psycopg

        with psycopg.connect(PG_DSN, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    if "redis" in stores:
        import redis

        client = redis.Redis.from_url(REDIS_URL)
        for key in client.scan_iter(f"{prefix}*"):
            client.delete(key)


if __name__ == "__main__":
    main()
