"""The benchmarks stay runnable: a very short run of each prints a row per store.

Speed goals are not asserted here (machines are noisy); this only keeps the scripts from
rotting when the stores' statements change.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.servers import postgres_reachable, redis_reachable, require

REPO = Path(__file__).resolve().parents[2]


def test_store_cycle_benchmark_runs_on_every_store() -> None:
    """``benchmarks/store_cycle.py`` with tiny bursts prints, per store, cycles/s through the
    library, on the raw driver, for the minimal pair and with a limited claim, and the
    ratios."""
    for name, (reachable, detail) in (("PostgreSQL", postgres_reachable()),
                                      ("Redis", redis_reachable())):
        require(name, reachable, detail)
    run = subprocess.run([sys.executable, "benchmarks/store_cycle.py", "--seconds", "0.05",
                          "--rounds", "2"], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    assert re.search(r"^store\s+library cycles/s\s+raw cycles/s\s+minimal cycles/s\s+lib/raw"
                     r"\s+lib/minimal\s+limited cycles/s\s+lib/limited$", run.stdout,
                     re.MULTILINE), run.stdout
    rows = {m.group(1): [float(g.replace(",", "")) for g in m.groups()[1:]] for m in re.finditer(
        r"^(sqlite|postgres|redis)\s+([\d,]+)\s+([\d,]+)\s+([\d,]+)\s+([\d.]+)\s+([\d.]+)"
        r"\s+([\d,]+)\s+([\d.]+)$", run.stdout, re.MULTILINE)}
    assert set(rows) == {"sqlite", "postgres", "redis"}, run.stdout
    assert all(value > 0 for values in rows.values() for value in values), run.stdout


def test_redis_replicas_benchmark_measures_both_sides() -> None:
    """``benchmarks/redis_replicas.py`` with tiny bursts starts a primary and a replica of its
    own and prints cycles/s without and with ``wait_replicas=1``, and their ratio."""
    run = subprocess.run([sys.executable, "-m", "benchmarks.redis_replicas", "--seconds", "0.05",
                          "--rounds", "2"], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    rates = re.findall(r"^(no wait|wait_replicas=1)\s+([\d,]+)$", run.stdout, re.MULTILINE)
    assert [side for side, _ in rates] == ["no wait", "wait_replicas=1"], run.stdout
    assert all(float(value.replace(",", "")) > 0 for _, value in rates), run.stdout
    assert re.search(r"^ratio wait/no wait: [\d.]+$", run.stdout, re.MULTILINE), run.stdout


def test_heartbeat_cost_benchmark_prints_a_row_per_store_and_loses_nothing() -> None:
    """``benchmarks/heartbeat_cost.py``, tiny (10 leases, short interval): a row per store and
    start pattern with round trips and leases renewed per interval, and 0 leases lost."""
    for name, (reachable, detail) in (("PostgreSQL", postgres_reachable()),
                                      ("Redis", redis_reachable())):
        require(name, reachable, detail)
    run = subprocess.run([sys.executable, "benchmarks/heartbeat_cost.py", "--leases", "10",
                          "--intervals", "1", "--interval", "0.5"],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    rows = {(m.group(1), m.group(2)): (float(m.group(3)), float(m.group(4)), int(m.group(5)))
            for m in re.finditer(r"^(sqlite|postgres|redis)\s+10\s+(aligned|staggered)\s+"
                                 r"[\d.]+\s+\d+\s+([\d.]+)\s+([\d.,]+)\s+\d+\s+(\d+)$",
                                 run.stdout, re.MULTILINE)}
    assert set(rows) == {(store, starts) for store in ("sqlite", "postgres", "redis")
                         for starts in ("aligned", "staggered")}, run.stdout
    assert all(trips > 0 and renewed > 0 for trips, renewed, _ in rows.values()), run.stdout
    assert all(lost == 0 for *_, lost in rows.values()), run.stdout

    found = re.search(r"^run (\w+):", run.stdout, re.MULTILINE)
    assert found, run.stdout
    import psycopg
    import redis

    from benchmarks import heartbeat_cost

    client = redis.Redis(host=heartbeat_cost.REDIS_HOST, port=heartbeat_cost.REDIS_PORT,
                         db=heartbeat_cost.REDIS_DB)
    try:
        assert not list(client.scan_iter(f"bench_hb_{found.group(1)}:*")), "redis keys left"
    finally:
        client.close()
    with psycopg.connect(heartbeat_cost.PG_DSN) as conn:
        left = conn.execute("SELECT 1 FROM pg_namespace WHERE nspname = %s",
                            (f"bench_hb_{found.group(1)}",)).fetchone()
    assert left is None, "schema left behind"


@pytest.mark.worker
def test_worker_throughput_benchmark_runs_real_workers_and_cleans_up() -> None:
    """``benchmarks/worker_throughput.py``, tiny: real prefork workers for plain, SQLite, Redis,
    PostgreSQL and SQLite without history print a rate, a ratio and CPU per task by process
    each (the run's own check that the no-history store wrote no history passed), and the run
    leaves no key or schema behind."""
    for name, (reachable, detail) in (("PostgreSQL", postgres_reachable()),
                                      ("Redis", redis_reachable())):
        require(name, reachable, detail)
    # --deadline below the subprocess timeout: the harness stops and cleans up by itself
    # first (and its workers die with it even if it is killed).
    run = subprocess.run([sys.executable, "benchmarks/worker_throughput.py",
                          "--variants", "plain,sqlite,redis,postgres,sqlite-nohistory",
                          "--body", "noop",
                          "--tasks", "50", "--rounds", "1", "--deadline", "100"],
                         cwd=REPO, capture_output=True, text=True, timeout=150)
    assert run.returncode == 0, run.stdout + run.stderr
    def number(text: str) -> float:
        return float(text.replace(",", ""))

    # variant body tasks tasks/s ratio publish/s, then CPU µs per task: worker, its main and
    # pool processes, +worker (the worker's over the plain runs around it; "-" for plain),
    # redis, postgres.
    found_rows = {m.group(1): m for m in re.finditer(
        r"^(plain|sqlite(?:-nohistory)?|redis|postgres)\s+noop\s+50\s+([\d,]+)\s+([\d.]+)"
        r"\s+[\d,]+\s+([\d,]+)\s+([\d,]+)\s+(-?[\d,]+)\s+(-|[+-][\d,]+)\s+([\d,]+)"
        r"\s+([\d,]+)\s", run.stdout, re.MULTILINE)}
    rows = {variant: (number(m.group(2)), float(m.group(3)), number(m.group(4)), m.group(7),
                      number(m.group(8)), number(m.group(9)))
            for variant, m in found_rows.items()}
    # The split adds up (each figure rounded to a µs): the main process and the pool
    # processes make the worker's figure.
    assert all(abs(number(m.group(5)) + number(m.group(6)) - number(m.group(4))) <= 1
               for m in found_rows.values()), run.stdout
    assert set(rows) == {"plain", "sqlite", "redis", "postgres", "sqlite-nohistory"}, \
        run.stdout
    assert all(rate > 0 and ratio > 0 for rate, ratio, *_ in rows.values()), run.stdout
    # Each worker used CPU; the store server's CPU lands in its own column: PostgreSQL's
    # processes worked for the postgres variant, and the Redis server for every variant (it
    # is the broker), more for the redis store's claims and finishes than for plain tasks.
    assert all(worker > 0 for _, _, worker, *_ in rows.values()), run.stdout
    assert rows["plain"][3] == "-" and all(row[3] != "-" for v, row in rows.items()
                                           if v != "plain"), run.stdout
    assert rows["postgres"][5] > 0 and all(row[4] > 0 for row in rows.values()), run.stdout
    assert rows["redis"][4] > rows["plain"][4], run.stdout

    found = re.search(r"^run (\w+):", run.stdout, re.MULTILINE)
    assert found, run.stdout
    prefix = f"bench_{found.group(1)}"
    import psycopg
    import redis

    from benchmarks import worker_throughput

    for db in (worker_throughput.BROKER_DB, worker_throughput.STORE_DB):
        client = redis.Redis(host=worker_throughput.REDIS_HOST,
                             port=worker_throughput.REDIS_PORT, db=db)
        assert not list(client.scan_iter(f"{prefix}:*")), f"keys left in db {db}"
        assert not list(client.scan_iter(f"qo_*{found.group(1)}*"))
    with psycopg.connect(worker_throughput.PG_DSN) as conn:
        left = conn.execute("SELECT nspname FROM pg_namespace WHERE nspname LIKE %s",
                            (f"{prefix}%",)).fetchall()
    assert not left, f"schemas left behind: {left}"


def test_worker_throughput_busy_variant_spends_its_cpu_in_a_plain_task() -> None:
    """``plain-busy``: a plain Celery task (no lease) whose body first spends the variant's CPU
    in a busy loop, both bodies (what it stands for: a pool process's cost per task close to a
    LeasedTask's, at a rate close to its)."""
    code = ("import time\n"
            "from benchmarks.worker_throughput_app import app\n"
            "from benchmarks.worker_variants import BUSY\n"
            "for body in ('noop', '10ms'):\n"
            "    task = app.tasks[f'bench.plain-busy.{body}']\n"
            "    assert type(task).__mro__[1] is app.Task, type(task).__mro__\n"
            "    assert 'LeasedTask' not in [c.__name__ for c in type(task).__mro__]\n"
            "    spent = []\n"
            "    for _ in range(5):\n"
            "        started = time.process_time()\n"
            "        task('batch', 1)\n"
            "        spent.append(time.process_time() - started)\n"
            "    assert min(spent) >= BUSY['plain-busy'] / 1e6, (body, spent)\n"
            "print('ok')\n")
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                         text=True, timeout=60,
                         env={**os.environ, "BENCH_VARIANTS": "plain-busy",
                              "PYTHONPATH": str(REPO)})
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr


def test_scale_benchmark_runs_tiny_on_every_store_and_cleans_up() -> None:
    """``benchmarks/scale.py --big 2000``: a table per store with a ratio column, exit 0, and
    no schema, key or file of the run left behind."""
    for name, (reachable, detail) in (("PostgreSQL", postgres_reachable()),
                                      ("Redis", redis_reachable())):
        require(name, reachable, detail)
    # Short windows and few cycles keep the three stores under a minute; --deadline below
    # the subprocess timeout lets the script stop and clean up by itself first.
    run = subprocess.run([sys.executable, "benchmarks/scale.py", "--big", "2000",
                          "--window", "0.3", "--cycles", "50", "--gets", "100",
                          "--deadline", "50"],
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
    for store in ("sqlite", "postgres", "redis"):
        assert re.search(rf"^== {store} \(1,000 vs 2,000 done rows; run \w+;", run.stdout,
                         re.MULTILINE), run.stdout
    ratios = re.findall(r"^claim\+finish p50 ms\s+[\d.,]+\s+[\d.,]+\s+([\d.]+)x",
                        run.stdout, re.MULTILINE)
    assert len(ratios) == 3 and all(float(r) > 0 for r in ratios), run.stdout
    assert run.stdout.count("lease_celery_leases_sweep: yes") == 2, run.stdout  # both SQLs

    found = re.search(r"run (\w+);", run.stdout)
    assert found, run.stdout
    import tempfile

    import psycopg
    import redis

    from benchmarks import scale

    client = redis.Redis(host=scale.REDIS_HOST, port=scale.REDIS_PORT, db=scale.REDIS_DB)
    try:
        assert not list(client.scan_iter(f"scale_{found.group(1)}_*")), "redis keys left"
    finally:
        client.close()
    with psycopg.connect(scale.PG_DSN) as conn:
        left = conn.execute("SELECT nspname FROM pg_namespace WHERE nspname LIKE %s",
                            (f"scale_{found.group(1)}_%",)).fetchall()
    assert not left, f"schemas left behind: {left}"
    leftover = list(Path(tempfile.gettempdir()).glob(f"lease_scale_{found.group(1)}_*"))
    assert not leftover, f"files left behind: {leftover}"


def test_history_cost_benchmark_prints_a_row_per_store() -> None:
    """``benchmarks/history_cost.py``, tiny: per store, µs per claim + finish with and without
    the history writes, the difference, its share, and the history's bytes per task."""
    for name, (reachable, detail) in (("PostgreSQL", postgres_reachable()),
                                      ("Redis", redis_reachable())):
        require(name, reachable, detail)
    run = subprocess.run([sys.executable, "benchmarks/history_cost.py", "--cycles", "20",
                          "--rounds", "2"], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    rows = {m.group(1): (float(m.group(2).replace(",", "")), float(m.group(3).replace(",", "")))
            for m in re.finditer(r"^(sqlite|postgres|redis)\s+([\d,]+)\s+([\d,]+)\s+-?[\d,]+"
                                 r"\s+-?\d+%\s+-?[\d,]+$", run.stdout, re.MULTILINE)}
    assert set(rows) == {"sqlite", "postgres", "redis"}, run.stdout
    assert all(with_it > 0 and without > 0 for with_it, without in rows.values()), run.stdout


def test_publish_record_benchmark_measures_both_sides() -> None:
    """``benchmarks/publish_record.py`` with tiny bursts prints, per store, publishes/s
    without and with the row written at publish, and their ratio."""
    run = subprocess.run([sys.executable, "-m", "benchmarks.publish_record", "--seconds",
                          "0.05", "--rounds", "2"], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    rows = re.findall(r"^(sqlite|postgres|redis)\s+([\d,]+)\s+([\d,]+)\s+([\d.]+)$",
                      run.stdout, re.MULTILINE)
    assert [row[0] for row in rows] == ["sqlite", "postgres", "redis"], run.stdout
    assert all(float(value.replace(",", "")) > 0 for row in rows for value in row[1:]), (
        run.stdout)


def test_the_cpu_meter_reads_the_redis_server_finer_than_a_clock_tick() -> None:
    """The Redis column of ``worker_throughput.py`` comes from the server's own account
    (``INFO cpu``, microseconds), not /proc's clock ticks: a tiny run's batch of 50 plain tasks
    costs the broker less than one tick (10 ms), which /proc read as 0 µs per task."""
    require("Redis", *redis_reachable())
    import os

    import redis

    from benchmarks.worker_throughput import REDIS_HOST, REDIS_PORT, CpuMeter

    with redis.Redis(host=REDIS_HOST, port=REDIS_PORT) as client:
        meter = CpuMeter(os.getpid(), redis=client)
        before = meter.read()
        for _ in range(200):
            client.ping()
        spent = CpuMeter.spent(before, meter.read())["redis"]
    tick_us = 1e6 / os.sysconf("SC_CLK_TCK")
    assert spent > 0 and round(spent * 1e6) % tick_us != 0, spent


def test_gate_cost_benchmark_measures_every_store_and_the_waits_and_cleans_up() -> None:
    """``benchmarks/gate_cost.py``, tiny: a CPU figure per side (plain, the canned store, each
    real store), each LeasedTask's over plain and each real store's part of it (over the
    canned store's); the client CPU of late answers per server; no schema or key of the run
    left behind."""
    for name, (reachable, detail) in (("PostgreSQL", postgres_reachable()),
                                      ("Redis", redis_reachable())):
        require(name, reachable, detail)
    import json

    import psycopg
    import redis

    from tests.support.servers import PG_DSN

    run = subprocess.run([sys.executable, "benchmarks/gate_cost.py", "--rounds", "1",
                          "--tasks", "20", "--waits", "--json"], cwd=REPO,
                         capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout)
    stores = {"canned", "sqlite", "postgres", "redis"}
    assert set(result["cpu_us"]) == stores | {"plain"}, result
    assert all(value > 0 for value in result["cpu_us"].values()), result
    assert set(result["extra_us"]) == stores, result
    assert set(result["store_part_us"]) == stores - {"canned"}, result
    assert set(result["waits_us"]) == {"postgres", "redis"}, result
    assert all(set(by_delay) == {"0", "250", "500"} and min(by_delay.values()) > 0
               for by_delay in result["waits_us"].values()), result
    with psycopg.connect(PG_DSN, autocommit=True) as conn:
        left = conn.execute("SELECT nspname FROM pg_namespace WHERE nspname LIKE 'gate\\_%'"
                            ).fetchall()
    assert left == [], left
    client = redis.Redis(host="127.0.0.1", port=6379, db=14)
    try:
        assert list(client.scan_iter(match="gate_*", count=1000)) == []
    finally:
        client.close()
