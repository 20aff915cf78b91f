"""Claim + finish cycles per second: through lease_celery, on the raw driver, and the minimum.

Three sides per store, measured in the same run in alternating rounds (the order rotating from
round to round) so that machine noise hits them alike:

- *library*: ``store.claim`` + ``store.finish`` on a fresh key;
- *raw*: the same statements (the library's own SQL / Lua, read from its files) on the raw
  driver, without the library around them;
- *limited*: ``store.claim_limited`` (a key-group limit of 1,000, so every claim takes a slot)
  + ``store.finish``: what a limited claim costs against a plain one (goal: at most 1.3x);
- *minimal*: the physical limit, the smallest pair a hand-written program could send on that
  driver to a tiny table (or hash) of its own with key, owner, token, expires_at, state and
  result: an upsert claim of the fresh key with ``RETURNING token``, then one fenced ``UPDATE``
  finish (state, owner, token and ``expires_at > now`` in its ``WHERE``); on Redis one claim
  script (``HINCRBY`` the token, ``HSET`` owner, deadline and state) and one fenced finish
  script. SQLite runs it with the same ``journal_mode`` and ``synchronous`` as the store.

    python benchmarks/store_cycle.py [--seconds 0.25] [--rounds 24]
        [--stores sqlite,postgres,redis,mysql]

Prints cycles/s for each side (mean over the bursts) and the ratios library / raw,
library / minimal and library / limited (the limited claim's cost, as a multiple). Needs
PostgreSQL, Redis and MariaDB on 127.0.0.1 (the test servers) for those rows; every side
removes its own tables and keys (MySQL: a database of the run's own).
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
MYSQL_URL = "mysql://root@127.0.0.1:3306"
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


def limited_cycle(url: str) -> tuple[Callable[[int], None], Callable[[], None]]:
    from lease_celery.limits import GroupLimit

    store = open_store(url)
    run = uuid.uuid4().hex[:8]
    group = GroupLimit(f"bench:{run}", limit=1000)

    def cycle(i: int) -> None:
        lease = store.claim_limited(f"lim:{run}:{i}", owner="bench", ttl=TTL, limit=group)
        assert lease is not None and store.finish(lease, RESULT)  # type: ignore[arg-type]

    return cycle, store.close


def store_synchronous(path: str) -> str:
    """The ``synchronous`` mode the library's SQLite store runs this file with (its default)."""
    with open_store(f"sqlite:///{path}") as store:
        return str(store.synchronous).upper()  # type: ignore[attr-defined]


def sqlite_connection(path: str) -> sqlite3.Connection:
    """A connection set up as the library's SQLite store sets up its own."""
    conn = sqlite3.connect(path, isolation_level=None, timeout=10)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute(f"PRAGMA synchronous={store_synchronous(path)}")
    return conn


def raw_sqlite(path: str) -> tuple[Callable[[int], None], Callable[[], None]]:
    q = load_queries("sqlite")
    conn = sqlite_connection(path)
    run = uuid.uuid4().hex[:8]

    def cycle(i: int) -> None:
        key = f"raw:{run}:{i}"
        conn.execute("BEGIN IMMEDIATE")
        now = time.time()
        token, *_ = conn.execute(q["claim"], {"key": key, "owner": "bench", "now": now,
                                              "expires_at": now + TTL, "task": None,
                                              "grp": None, "slot": None}).fetchone()
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


def _mysql(database: str | None = None) -> Any:
    import pymysql

    flags = pymysql.constants.CLIENT
    return pymysql.connect(host="127.0.0.1", port=3306, user="root", database=database,
                           autocommit=True,
                           client_flag=flags.FOUND_ROWS | flags.MULTI_STATEMENTS)


def raw_mysql(url: str) -> tuple[Callable[[int], None], Callable[[], None]]:
    """The store's own statements (its queries, as the store put them together) on a bare
    PyMySQL connection: the claim batch (the upsert and its read-back by nonce in one
    transaction, one round trip), the finish."""
    store = open_store(url)
    store.get("warm-up")  # the schema, and the queries for this server
    q = store._q  # type: ignore[attr-defined]
    store.close()
    conn = _mysql(url.rsplit("/", 1)[1])
    cur = conn.cursor()
    run = uuid.uuid4().hex[:8]

    def cycle(i: int) -> None:
        params = {"key": f"raw:{run}:{i}", "owner": "bench", "ttl": TTL, "now": None,
                  "task": None, "nonce": uuid.uuid4().hex, "grp": None, "slot": None}
        cur.execute(q["claim_batch"], params)
        token = None
        while True:
            if cur.description:
                (token, *_rest) = cur.fetchone()
            if not cur.nextset():
                break
        assert cur.execute(q["finish"], {**params, "token": token, "settle_within": None,
                                         "result": json.dumps(RESULT)}) == 1

    return cycle, conn.close


def minimal_mysql(url: str) -> tuple[Callable[[int], None], Callable[[], None]]:
    """An upsert claim and a fenced finish on a table of their own; MySQL has no RETURNING:
    the token is read back (LAST_INSERT_ID carries it out of the upsert in one statement)."""
    conn = _mysql(url.rsplit("/", 1)[1])
    cur = conn.cursor()
    cur.execute(f"CREATE TABLE IF NOT EXISTS {MINIMAL_TABLE} (k VARCHAR(255) PRIMARY KEY, "
                "owner TEXT, token BIGINT, expires_at DOUBLE, state VARCHAR(8), result TEXT)")
    run = uuid.uuid4().hex[:8]
    clock = "UNIX_TIMESTAMP(SYSDATE(6))"

    def cycle(i: int) -> None:
        key = f"min:{run}:{i}"
        cur.execute(f"INSERT INTO {MINIMAL_TABLE} VALUES (%s, %s, LAST_INSERT_ID(1), "
                    f"{clock} + %s, 'running', NULL) ON DUPLICATE KEY UPDATE "
                    "token = LAST_INSERT_ID(token + 1)", (key, "bench", TTL))
        token = conn.insert_id()
        assert cur.execute(f"UPDATE {MINIMAL_TABLE} SET state = 'done', result = %s WHERE "
                           f"k = %s AND owner = %s AND token = %s AND state = 'running' AND "
                           f"expires_at > {clock}", (json.dumps(RESULT), key, "bench",
                                                     token)) == 1

    def close() -> None:
        cur.execute(f"DROP TABLE IF EXISTS {MINIMAL_TABLE}")
        conn.close()

    return cycle, close


def raw_redis(url: str) -> tuple[Callable[[int], None], Callable[[], None]]:
    import redis

    # The prelude: the helpers, history caps filled in.
    from lease_celery.stores.redis.lua import PRELUDE, SCRIPTS

    client = redis.Redis.from_url(REDIS_URL, decode_responses=True)
    claim = client.register_script(PRELUDE + "\n" + SCRIPTS["claim"])
    finish = client.register_script(PRELUDE + "\n" + SCRIPTS["fenced_write"])
    prefix = url.split("prefix=")[1]
    run = uuid.uuid4().hex[:8]
    # Every script's first two arguments: the epoch record and the epoch the store opened.
    with open_store(url) as store:
        epoch = store.epoch()
    assert epoch is not None
    header = [f"{prefix}epoch", epoch.id]

    def cycle(i: int) -> None:
        keys = [f"{prefix}lease:raw:{run}:{i}", f"{prefix}token:raw:{run}:{i}", f"{prefix}fence",
                f"{prefix}running"]
        token, *_ = claim(keys=keys, args=[*header, "", "bench", repr(TTL), "",
                                           uuid.uuid4().hex])
        assert finish(keys=[keys[0], keys[3]], args=[*header, "", "bench", token, "done",
                                                     json.dumps(RESULT), "", "0.0", ""])

    return cycle, client.close


# -- the minimal pair: the physical limit on each driver ----------------------------------

MINIMAL_TABLE = "bench_minimal_leases"
MINIMAL_SQLITE = {
    "create": f"""CREATE TABLE IF NOT EXISTS {MINIMAL_TABLE} (
        key TEXT PRIMARY KEY, owner TEXT NOT NULL, token INTEGER NOT NULL,
        expires_at REAL NOT NULL, state TEXT NOT NULL, result TEXT)""",
    "claim": f"""INSERT INTO {MINIMAL_TABLE} (key, owner, token, expires_at, state)
        VALUES (:key, :owner, 1, :expires_at, 'running')
        ON CONFLICT (key) DO UPDATE SET owner = excluded.owner, token = token + 1,
            expires_at = excluded.expires_at, state = 'running', result = NULL
        WHERE state = 'running' AND expires_at <= :now
        RETURNING token""",
    "finish": f"""UPDATE {MINIMAL_TABLE} SET state = 'done', result = :result
        WHERE key = :key AND owner = :owner AND token = :token AND state = 'running'
          AND expires_at > :now""",
}
PG_NOW = "extract(epoch FROM clock_timestamp())::double precision"
MINIMAL_POSTGRES = {
    "create": """CREATE TABLE IF NOT EXISTS {table} (
        key text PRIMARY KEY, owner text NOT NULL, token bigint NOT NULL,
        expires_at double precision NOT NULL, state text NOT NULL, result text)""",
    "claim": f"""INSERT INTO {{table}} AS m (key, owner, token, expires_at, state)
        VALUES (%(key)s, %(owner)s, 1, {PG_NOW} + %(ttl)s, 'running')
        ON CONFLICT (key) DO UPDATE SET owner = excluded.owner, token = m.token + 1,
            expires_at = excluded.expires_at, state = 'running', result = NULL
        WHERE m.state = 'running' AND m.expires_at <= {PG_NOW}
        RETURNING token""",
    "finish": f"""UPDATE {{table}} SET state = 'done', result = %(result)s
        WHERE key = %(key)s AND owner = %(owner)s AND token = %(token)s AND state = 'running'
          AND expires_at > {PG_NOW}""",
}
REDIS_NOW = "local t = redis.call('TIME'); local now = t[1] + t[2] / 1000000\n"
#: KEYS[1] the lease hash; ARGV owner, ttl. The new token, or nil when a live lease holds it.
MINIMAL_REDIS_CLAIM = REDIS_NOW + """
local lease = redis.call('HMGET', KEYS[1], 'state', 'expires_at')
if lease[1] and not (lease[1] == 'running' and tonumber(lease[2]) <= now) then return nil end
local token = redis.call('HINCRBY', KEYS[1], 'token', 1)
redis.call('HSET', KEYS[1], 'owner', ARGV[1], 'expires_at', tostring(now + ARGV[2]),
           'state', 'running')
return token
"""
#: KEYS[1] the lease hash; ARGV owner, token, result. 1 if written, 0 if not current.
MINIMAL_REDIS_FINISH = REDIS_NOW + """
local lease = redis.call('HMGET', KEYS[1], 'state', 'owner', 'token', 'expires_at')
if lease[1] ~= 'running' or lease[2] ~= ARGV[1] or lease[3] ~= ARGV[2]
   or tonumber(lease[4]) <= now then return 0 end
redis.call('HSET', KEYS[1], 'state', 'done', 'result', ARGV[3])
return 1
"""


def minimal_sqlite(path: str) -> tuple[Callable[[int], None], Callable[[], None]]:
    conn = sqlite_connection(path)
    conn.execute(MINIMAL_SQLITE["create"])
    run = uuid.uuid4().hex[:8]

    def cycle(i: int) -> None:
        # Autocommit: each statement is its own transaction, one commit each (as the library).
        key, now = f"min:{run}:{i}", time.time()
        [(token,)] = conn.execute(MINIMAL_SQLITE["claim"], {
            "key": key, "owner": "bench", "now": now, "expires_at": now + TTL}).fetchall()
        cur = conn.execute(MINIMAL_SQLITE["finish"], {
            "key": key, "owner": "bench", "token": token, "now": time.time(),
            "result": json.dumps(RESULT)})
        assert cur.rowcount == 1

    def close() -> None:
        conn.execute(f"DROP TABLE IF EXISTS {MINIMAL_TABLE}")
        conn.close()

    return cycle, close


def minimal_postgres(url: str) -> tuple[Callable[[int], None], Callable[[], None]]:
    import psycopg

    schema = url.split("schema=")[1]
    table = f'"{schema}".{MINIMAL_TABLE}'
    q = {name: sql.replace("{table}", table) for name, sql in MINIMAL_POSTGRES.items()}
    conn = psycopg.connect(PG_DSN, autocommit=True)
    conn.execute(f'CREATE SCHEMA IF NOT EXISTS "{schema}"')
    conn.execute(q["create"])
    run = uuid.uuid4().hex[:8]

    def cycle(i: int) -> None:
        key = f"min:{run}:{i}"
        row = conn.execute(q["claim"], {"key": key, "owner": "bench", "ttl": TTL}).fetchone()
        assert row is not None
        cur = conn.execute(q["finish"], {"key": key, "owner": "bench", "token": row[0],
                                         "result": json.dumps(RESULT)})
        assert cur.rowcount == 1

    def close() -> None:
        conn.execute(f"DROP TABLE IF EXISTS {table}")
        conn.close()

    return cycle, close


def minimal_redis(url: str) -> tuple[Callable[[int], None], Callable[[], None]]:
    import redis

    client = redis.Redis.from_url(REDIS_URL, decode_responses=True)
    claim = client.register_script(MINIMAL_REDIS_CLAIM)
    finish = client.register_script(MINIMAL_REDIS_FINISH)
    prefix = f"{url.split('prefix=')[1]}minimal:{uuid.uuid4().hex[:8]}:"

    def cycle(i: int) -> None:
        key = f"{prefix}{i}"
        token = claim(keys=[key], args=["bench", repr(TTL)])
        assert token is not None
        assert finish(keys=[key], args=["bench", token, json.dumps(RESULT)]) == 1

    def close() -> None:
        for key in client.scan_iter(f"{prefix}*", count=1000):
            client.delete(key)
        client.close()

    return cycle, close


# -- the run ------------------------------------------------------------------------------

Side = Callable[[str], tuple[Callable[[int], None], Callable[[], None]]]


def alternate(sides: dict[str, tuple[Callable[[int], None], Callable[[], None]]],
              seconds: float, rounds: int) -> dict[str, float]:
    """Mean cycles/s of each side (its cycle and its close), warmed up once (connect, create
    the schema, open the epoch, load scripts), then measured in ``rounds`` bursts of
    ``seconds`` each; every side is closed at the end.

    Many short bursts, the order rotating from round to round: a slow patch of the machine
    (fsync stalls, the other core busy) lands on every side instead of deciding the ratios.
    """
    rates: dict[str, list[float]] = {side: [] for side in sides}
    order = list(sides)
    try:
        for cycle, _ in sides.values():
            cycle(-1)
        for n in range(rounds):
            turn = n % len(order)
            for side in order[turn:] + order[:turn]:
                rates[side].append(rate(sides[side][0], seconds))
    finally:
        for _, close in sides.values():
            close()
    return {side: statistics.mean(values) for side, values in rates.items()}


def measure(name: str, url: str, raw: Side, minimal: Side, seconds: float,
            rounds: int) -> dict[str, Any]:
    target = url.removeprefix("sqlite:///") if name == "sqlite" else url
    sides = {"library": library_cycle(url)}  # first: it creates the schema the raw side uses
    sides |= {"raw": raw(target), "minimal": minimal(target), "limited": limited_cycle(url)}
    mean = alternate(sides, seconds, rounds)
    return {"store": name, **mean, "ratio": mean["library"] / mean["raw"],
            "ratio_minimal": mean["library"] / mean["minimal"],
            "ratio_limited": mean["library"] / mean["limited"]}


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
            "sqlite": (f"sqlite:///{Path(tmp) / 'bench.sqlite3'}", raw_sqlite, minimal_sqlite),
            "postgres": (f"{PG_DSN}?schema={schema}", raw_postgres, minimal_postgres),
            "redis": (f"{REDIS_URL}?prefix={prefix}", raw_redis, minimal_redis),
            "mysql": (f"{MYSQL_URL}/{schema}", raw_mysql, minimal_mysql),
        }
        if "mysql" in args.stores:  # the store makes its tables, not its database
            _mysql().cursor().execute(f"CREATE DATABASE IF NOT EXISTS `{schema}`")
        try:
            for name in args.stores.split(","):
                url, raw, minimal = targets[name]
                rows.append(measure(name, url, raw, minimal, args.seconds, args.rounds))
        finally:
            cleanup(schema, prefix, args.stores)
    print(f"{'store':<10}{'library cycles/s':>18}{'raw cycles/s':>14}{'minimal cycles/s':>18}"
          f"{'lib/raw':>9}{'lib/minimal':>13}{'limited cycles/s':>18}{'lib/limited':>13}")
    for row in rows:
        print(f"{row['store']:<10}{row['library']:>18,.0f}{row['raw']:>14,.0f}"
              f"{row['minimal']:>18,.0f}{row['ratio']:>9.2f}{row['ratio_minimal']:>13.2f}"
              f"{row['limited']:>18,.0f}{row['ratio_limited']:>13.2f}")


def cleanup(schema: str, prefix: str, stores: str) -> None:
    if "postgres" in stores:
        import psycopg

        with psycopg.connect(PG_DSN, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    if "mysql" in stores:
        _mysql().cursor().execute(f"DROP DATABASE IF EXISTS `{schema}`")
    if "redis" in stores:
        import redis

        client = redis.Redis.from_url(REDIS_URL)
        for key in client.scan_iter(f"{prefix}*"):
            client.delete(key)


if __name__ == "__main__":
    main()
