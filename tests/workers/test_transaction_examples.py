"""The runnable examples of docs/transactions.md, one per kind of app connection, run as a
user runs them: each tells its story with a real Celery worker and prints what happened."""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.support.servers import PG_DSN, postgres_reachable, require
from tests.support.workers import REPO


def _run(module: str, *args: str) -> str:
    done = subprocess.run([sys.executable, "-m", f"examples.transactions.{module}", *args],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def _check_story(output: str) -> None:
    """Orders 1 and 2 paid once each (order 1's second request answered, not run); order 3,
    rolled back with its enqueue, neither stored nor paid."""
    lines = output.splitlines()
    assert "order 1: 1 payment(s)" in lines and "order 2: 1 payment(s)" in lines, output
    assert "order 3: rolled back before commit, its payment never queued" in lines, output
    assert not [line for line in lines if line.startswith("order 3:") and "payment(s)" in line]
    answers = [line.split(": ", 1)[1] for line in lines if line.startswith("payment ")]
    assert answers == ["{'order': 1, 'token': 1}", "{'order': 2, 'token': 1}",
                       "{'order': 1, 'token': 1}"], output


def test_the_sqlite3_example(tmp_path: Path) -> None:
    _check_story(_run("sqlite3_orders", str(tmp_path)))


@pytest.mark.parametrize("module", ["psycopg_orders", "sqlalchemy_orders"])
def test_the_postgres_examples(module: str) -> None:
    reachable, detail = postgres_reachable()
    require("PostgreSQL", reachable, detail)
    schema = f"example_{uuid.uuid4().hex[:10]}"
    try:
        _check_story(_run(module, PG_DSN, schema))
    finally:
        import psycopg

        with psycopg.connect(PG_DSN, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
