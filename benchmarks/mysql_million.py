"""The MySQL store's operator reads, sweep and retention at a million settled rows: their
plans (EXPLAIN: which index, never a scan of the table) and their times.

    python -m benchmarks.mysql_million [--url mysql://root@127.0.0.1:3306] [--rows 1000000]

Fills a database of its own (``lease_million_<run>``, dropped after) with settled rows
through MariaDB's sequence engine (one dead in fifty, the rest done), claims 20 live keys
through the store, and prints each read's plan and its best time of five.
"""

from __future__ import annotations

import argparse
import time
import uuid
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import pymysql

from lease_celery import LeaseState, open_store
from lease_celery.stores.sql_glue import find_query

FIND = {"prefix": None, "owner": None, "limit": 20}


def best_ms(call: Callable[[], Any], runs: int = 5) -> float:
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return min(times) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="mysql://root@127.0.0.1:3306")
    parser.add_argument("--rows", type=int, default=1_000_000)
    args = parser.parse_args()
    parts = urlsplit(args.url)
    name = f"lease_million_{uuid.uuid4().hex[:8]}"
    admin = pymysql.connect(host=parts.hostname or "127.0.0.1", port=parts.port or 3306,
                            user=parts.username or "root", password=parts.password or "",
                            autocommit=True)
    cur = admin.cursor()
    cur.execute(f"CREATE DATABASE {name}")
    try:
        store = open_store(f"{args.url}/{name}")
        store.get("warm-up")  # the schema
        cur.execute(f"USE {name}")
        started = time.perf_counter()
        cur.execute("INSERT INTO lease_celery_leases (`key`, state, owner, token, expires_at, "
                    "updated_at, result) SELECT CONCAT('old:', seq), IF(seq % 50 = 0, 'dead', "
                    f"'done'), 'w', 1, seq, seq, '1' FROM seq_1_to_{args.rows}")
        print(f"filled {args.rows:,} settled rows in {time.perf_counter() - started:.1f} s")
        for i in range(20):
            store.claim(f"live:{i}", owner="w", ttl=300,
                        task={"task": "t", "options": {"task_id": str(i)}})
        cur.execute("ANALYZE TABLE lease_celery_leases")
        cur.fetchall()
        queries = store._q  # type: ignore[attr-defined]
        plans = {"stats": {"now": None}, find_query(None): FIND,
                 find_query(LeaseState.DONE): FIND, find_query(LeaseState.DEAD): FIND,
                 find_query(LeaseState.RUNNING): FIND,
                 "sweep_candidates": {"now": None, "at": 2e9, "grace": 5.0, "limit": 100},
                 "purge_old_candidates": {"now": None, "seconds": 10.0, "limit": 1000}}
        for query, params in plans.items():
            cur.execute("EXPLAIN " + queries[query], params)
            steps = [f"{row[2]}:{row[3]}:{row[5]}" for row in cur.fetchall()]
            print(f"{query:22} {'  '.join(steps)}")
        timed: dict[str, Callable[[], Any]] = {
            "stats()": store.stats,
            "find(limit=20)": lambda: store.find(limit=20),
            "find(state=done, limit=20)": lambda: store.find(state=LeaseState.DONE, limit=20),
            "find(state=dead, limit=20)": lambda: store.find(state=LeaseState.DEAD, limit=20),
            "find(state=running)": lambda: store.find(state=LeaseState.RUNNING, limit=20),
            "sweep_expired(limit=100)": lambda: store.sweep_expired(limit=100, grace=5),
        }
        for label, call in timed.items():
            print(f"{label:28} {best_ms(call):8.1f} ms")
        started = time.perf_counter()
        purged = store.purge_older_than(0, limit=1000)
        print(f"{'purge_older_than(limit=1000)':28} {(time.perf_counter() - started) * 1000:8.1f}"
              f" ms ({purged} rows)")
        store.close()
    finally:
        cur.execute(f"DROP DATABASE IF EXISTS {name}")
        admin.close()


if __name__ == "__main__":
    main()
