"""The benchmark stays runnable: a very short run prints a row per store with a ratio.

Speed goals are not asserted here (machines are noisy); this only keeps the script from
rotting when the stores' statements change.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.servers import postgres_reachable, redis_reachable, require

REPO = Path(__file__).resolve().parent.parent


def test_store_cycle_benchmark_runs_on_every_store() -> None:
    """``benchmarks/store_cycle.py`` with tiny bursts prints cycles/s and a ratio per store."""
    for name, (reachable, detail) in (("PostgreSQL", postgres_reachable()),
                                      ("Redis", redis_reachable())):
        require(name, reachable, detail)
    run = subprocess.run([sys.executable, "benchmarks/store_cycle.py", "--seconds", "0.05",
                          "--rounds", "2"], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    rows = {m.group(1): float(m.group(2)) for m in re.finditer(
        r"^(sqlite|postgres|redis)\s+[\d,]+\s+[\d,]+\s+([\d.]+)$", run.stdout, re.MULTILINE)}
    assert set(rows) == {"sqlite", "postgres", "redis"}, run.stdout
    assert all(ratio > 0 for ratio in rows.values())



@pytest.mark.worker
def test_throughput_benchmark_runs_real_workers_and_cleans_up() -> None:
    """``benchmarks/throughput.py``, tiny: real prefork workers for plain, SQLite, Redis and
    PostgreSQL print a rate and a ratio each, and the run leaves no key or schema behind."""
    for name, (reachable, detail) in (("PostgreSQL", postgres_reachable()),
                                      ("Redis", redis_reachable())):
        require(name, reachable, detail)
    # --deadline below the subprocess timeout: the harness stops and cleans up by itself
    # first (and its workers die with it even if it is killed).
    run = subprocess.run([sys.executable, "benchmarks/throughput.py",
                          "--variants", "plain,sqlite,redis,postgres", "--body", "noop",
                          "--tasks", "50", "--rounds", "1", "--deadline", "100"],
                         cwd=REPO, capture_output=True, text=True, timeout=150)
    assert run.returncode == 0, run.stdout + run.stderr
    rows = {m.group(1): (float(m.group(2).replace(",", "")), float(m.group(3)))
            for m in re.finditer(r"^(plain|sqlite|redis|postgres)\s+noop\s+50\s+([\d,]+)"
                                 r"\s+([\d.]+)\s", run.stdout, re.MULTILINE)}
    assert set(rows) == {"plain", "sqlite", "redis", "postgres"}, run.stdout
    assert all(rate > 0 and ratio > 0 for rate, ratio in rows.values()), run.stdout

    found = re.search(r"^run (\w+):", run.stdout, re.MULTILINE)
    assert found, run.stdout
    prefix = f"bench_{found.group(1)}"
    import psycopg
    import redis

    from benchmarks import throughput

    for db in (throughput.BROKER_DB, throughput.STORE_DB):
        client = redis.Redis(host=throughput.REDIS_HOST, port=throughput.REDIS_PORT, db=db)
        assert not list(client.scan_iter(f"{prefix}:*")), f"keys left in db {db}"
        assert not list(client.scan_iter(f"qo_*{found.group(1)}*"))
    with psycopg.connect(throughput.PG_DSN) as conn:
        left = conn.execute("SELECT 1 FROM pg_namespace WHERE nspname = %s",
                            (prefix,)).fetchone()
    assert left is None, f"schema {prefix} left behind"


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
