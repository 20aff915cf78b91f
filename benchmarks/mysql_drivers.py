"""The MySQL store's driver, chosen by measuring: PyMySQL, mysqlclient (MySQLdb) and MariaDB
Connector/Python (mariadb), on the three questions of issue 40.

1. *CPU per statement*: the process's CPU time (``time.process_time``) per lease-sized
   statement on a kept connection: a primary-key ``SELECT`` of one row and a fenced
   ``UPDATE`` (state, owner, token and the clock in its ``WHERE``), alternating the drivers in
   rounds so that machine noise hits them alike. Median of the rounds, microseconds.
2. *A dropped connection*: the server kills the connection (``KILL CONNECTION``) between two
   statements; what the next statement raises (class and error code), which decides whether
   the store can tell "connection lost" (try again) from a refused statement.
3. *Fork safety*: a connection made before ``fork()``; the child uses it while the parent does
   too. Whether the two processes' statements interleave on one socket (answers crossed or a
   protocol error), which is why the store keeps a connection per process (``PerProcess``).

    python -m benchmarks.mysql_drivers [--url mysql://root@127.0.0.1:3306] [--rounds 15]

Needs the server of the URL; uses a database of its own, dropped at the end. Prints a table
and, with ``--json``, the figures.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
import uuid
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

DRIVERS = ("pymysql", "mysqlclient", "mariadb")
SELECT = "SELECT token, expires_at, owner FROM bench WHERE k = %s"
UPDATE = ("UPDATE bench SET result = %s, state = 'done' WHERE k = %s AND state = 'running' "
          "AND owner = %s AND token = %s AND expires_at > UNIX_TIMESTAMP(SYSDATE(6))")


def connect(driver: str, url: str, database: str | None) -> Any:
    parts = urlsplit(url)
    args: dict[str, Any] = {"host": parts.hostname or "127.0.0.1", "port": parts.port or 3306,
                            "user": parts.username or "root",
                            "password": parts.password or ""}
    if database:
        args["database"] = database
    if driver == "pymysql":
        import pymysql

        return pymysql.connect(**args, autocommit=True)
    if driver == "mysqlclient":
        import MySQLdb

        conn = MySQLdb.connect(**{("passwd" if k == "password" else k): v
                                  for k, v in args.items()})
        conn.autocommit(True)
        return conn
    import mariadb

    return mariadb.connect(**args, autocommit=True)


def cpu_per_statement(conns: dict[str, Any], rounds: int, per_round: int) -> dict[str, Any]:
    """Median µs of CPU per SELECT and per UPDATE, per driver."""
    samples: dict[str, dict[str, list[float]]] = {d: {"select": [], "update": []}
                                                  for d in conns}
    for round_no in range(rounds):
        order = list(conns)[round_no % len(conns):] + list(conns)[:round_no % len(conns)]
        for driver in order:
            cur = conns[driver].cursor()
            for name, sql, params in (
                    ("select", SELECT, ("k1",)),
                    ("update", UPDATE, ("r", "k1", "w", 1))):
                started = time.process_time()
                for _ in range(per_round):
                    cur.execute(sql, params)
                    if name == "select":
                        cur.fetchall()
                samples[driver][name].append(
                    (time.process_time() - started) / per_round * 1e6)
            cur.close()
    return {driver: {name: round(statistics.median(values), 1)
                     for name, values in by.items()} for driver, by in samples.items()}


def dropped(driver: str, url: str, database: str, admin: Any) -> str:
    """What the next statement raises after the server killed the connection."""
    conn = connect(driver, url, database)
    cur = conn.cursor()
    cur.execute("SELECT CONNECTION_ID()")
    (conn_id,) = cur.fetchone()
    admin.cursor().execute(f"KILL CONNECTION {int(conn_id)}")
    time.sleep(0.1)
    try:
        cur.execute(SELECT, ("k1",))
        cur.fetchall()
    except Exception as exc:
        code = exc.args[0] if exc.args and isinstance(exc.args[0], int) else getattr(
            exc, "errno", None)
        return f"{type(exc).__module__}.{type(exc).__name__} code={code}: {exc}"[:120]
    finally:
        with contextlib.suppress(Exception):
            conn.close()
    return "nothing raised: the statement ran on a new connection (reconnected silently)"


def forked(driver: str, url: str, database: str, statements: int = 300) -> str:
    """Parent and child use one connection made before fork(): crossed answers or errors."""
    conn = connect(driver, url, database)
    pid = os.fork()
    crossed = errors = 0
    mine = "child" if pid == 0 else "parent"
    try:
        cur = conn.cursor()
        for _ in range(statements):
            try:
                cur.execute("SELECT %s", (mine,))
                row = cur.fetchone()
                if row is None or row[0] != mine:
                    crossed += 1
            except Exception:
                errors += 1
                break
    finally:
        if pid == 0:
            os._exit(1 if crossed or errors else 0)
    _, status = os.waitpid(pid, 0)
    child_bad = os.waitstatus_to_exitcode(status) != 0
    with contextlib.suppress(Exception):
        conn.close()
    if crossed or errors or child_bad:
        return (f"unsafe: parent saw {crossed} crossed answers, {errors} errors; child "
                f"{'failed' if child_bad else 'ok'}")
    return "no interleaving seen in this run (still one socket shared: unsafe by design)"


@contextlib.contextmanager
def bench_database(url: str) -> Iterator[str]:
    import pymysql

    parts = urlsplit(url)
    admin = pymysql.connect(host=parts.hostname or "127.0.0.1", port=parts.port or 3306,
                            user=parts.username or "root", password=parts.password or "",
                            autocommit=True)
    name = f"lease_bench_{uuid.uuid4().hex[:8]}"
    with admin.cursor() as cur:
        cur.execute(f"CREATE DATABASE {name}")
        cur.execute(f"CREATE TABLE {name}.bench (k VARCHAR(64) PRIMARY KEY, state VARCHAR(8), "
                    "owner TEXT, token BIGINT, expires_at DOUBLE, result TEXT)")
        cur.execute(f"INSERT INTO {name}.bench VALUES ('k1', 'running', 'w', 1, 1e12, NULL)")
    try:
        yield name
    finally:
        with admin.cursor() as cur:
            cur.execute(f"DROP DATABASE {name}")
        admin.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="mysql://root@127.0.0.1:3306")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--per-round", type=int, default=400)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    import pymysql

    parts = urlsplit(args.url)
    with bench_database(args.url) as name:
        conns: dict[str, Any] = {}
        for driver in DRIVERS:
            with contextlib.suppress(ImportError):
                conns[driver] = connect(driver, args.url, name)
        cpu = cpu_per_statement(conns, args.rounds, args.per_round)
        admin = pymysql.connect(host=parts.hostname or "127.0.0.1", port=parts.port or 3306,
                                user=parts.username or "root", password=parts.password or "",
                                autocommit=True)
        report: dict[str, Any] = {}
        for driver in conns:
            report[driver] = {"cpu_us": cpu[driver],
                              "dropped": dropped(driver, args.url, name, admin),
                              "fork": forked(driver, args.url, name)}
            conns[driver].close()
        admin.close()
    if args.json:
        print(json.dumps(report, indent=2))
        return
    for driver, found in report.items():
        print(f"{driver:12} select {found['cpu_us']['select']:6.1f} µs CPU   "
              f"update {found['cpu_us']['update']:6.1f} µs CPU")
        print(f"{'':12} dropped: {found['dropped']}")
        print(f"{'':12} fork:    {found['fork']}")


if __name__ == "__main__":
    main()
