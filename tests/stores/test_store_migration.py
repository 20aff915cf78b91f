"""Opening a store written by an older schema migrates it in place. Schema 1 (before the
settle phase): rows keep their tokens and results, done rows count as settled, and rows the
sweeper must watch are found by the new index. Schema 7 (before the receipts' state index), on
every SQL store: the index is made and the receipts are kept."""

from __future__ import annotations

import contextlib
import sqlite3
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from lease_celery import EffectState, Lease, LeaseState, LimitRefused, open_store
from lease_celery.limits import GroupLimit
from lease_celery.stores.sql_glue import SCHEMA_VERSION
from lease_celery.testing import ManualClock
from tests.support.servers import PG_DSN, postgres_reachable, require

TASK = '{"task": "proj.t", "args": [], "kwargs": {}, "options": {"task_id": "t-1"}}'

SQLITE_SCHEMA_1 = """
CREATE TABLE lease_celery_leases (
    key TEXT PRIMARY KEY, state TEXT NOT NULL, owner TEXT, token INTEGER NOT NULL,
    expires_at REAL, attempts INTEGER NOT NULL DEFAULT 0, takeovers INTEGER NOT NULL DEFAULT 0,
    not_before REAL, reason TEXT, task TEXT, swept_token INTEGER, result TEXT,
    updated_at REAL NOT NULL, fence INTEGER NOT NULL DEFAULT 0) WITHOUT ROWID;
CREATE TABLE lease_celery_meta (name TEXT PRIMARY KEY, value TEXT NOT NULL) WITHOUT ROWID;
INSERT INTO lease_celery_meta VALUES ('schema_version', '1');
"""

PG_SCHEMA_1 = """
CREATE TABLE {s}.lease_celery_leases (
    key text PRIMARY KEY, state text NOT NULL, owner text, token bigint NOT NULL,
    expires_at double precision, attempts integer NOT NULL DEFAULT 0,
    takeovers integer NOT NULL DEFAULT 0, not_before double precision, reason text, task text,
    swept_token bigint, nonce text, result text, updated_at double precision NOT NULL,
    fence bigint NOT NULL DEFAULT 0);
CREATE TABLE {s}.lease_celery_meta (name text PRIMARY KEY, value text NOT NULL);
INSERT INTO {s}.lease_celery_meta VALUES ('schema_version', '1');
"""

ROWS = [  # key, state, owner, token, expires_at, result, updated_at
    ("done", "done", "w", 3, 100.0, '{"n": 1}', 100.0),
    ("running", "running", "w", 2, 110.0, None, 100.0),
    ("ready", "ready", "w", 1, 100.0, None, 100.0),
]


def check_migrated(url: str) -> None:
    clock = ManualClock(200.0)
    with open_store(url, clock=clock) as store:
        done = store.get("done")
        assert done is not None
        assert (done.state, done.token, done.result, done.settling) == (
            LeaseState.DONE, 3, {"n": 1}, False)
        # The expired running row and the long-unclaimed ready row are both due.
        assert sorted((r.key, r.token) for r in store.sweep_expired(grace=60)) == [
            ("ready", 1), ("running", 2)]
        lease = store.claim("running", owner="w2", ttl=10)
        assert lease is not None and lease.token == 3
        assert store.finish(lease, "ok", settle_within=5)
        assert store.get("running").settling is True  # type: ignore[union-attr]
        # Schema 5: the migrated store writes the transitions into the history itself.
        assert [(e.event, e.token, e.detail) for e in store.history("running")] == [
            ("taken_over", 3, "the lease of w (token 2) had lapsed"), ("finished", 3, None)]
        # Schema 6: key-group limits on the migrated rows (a slot, a waiter, a hand-on).
        group = GroupLimit("migrated", limit=1)
        slot = store.claim_limited("limited", owner="w", ttl=10, limit=group)
        assert isinstance(slot, Lease) and slot.slot == 1
        waiting = store.claim_limited("new", owner="w", ttl=10, limit=group,
                                      task={"task": "t", "args": []})
        assert isinstance(waiting, LimitRefused) and waiting.parked
        assert store.finish(slot, None)
        assert [w.key for w in store.hand_on("migrated")] == ["new"]


def test_sqlite_schema_1_is_migrated(tmp_path: pytest.TempPathFactory) -> None:
    path = f"{tmp_path}/old.sqlite3"
    conn = sqlite3.connect(path)
    conn.executescript(SQLITE_SCHEMA_1)
    conn.executemany("INSERT INTO lease_celery_leases (key, state, owner, token, expires_at, "
                     "result, updated_at, task) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                     [(*row, TASK) for row in ROWS])
    conn.commit()
    conn.close()
    check_migrated(f"sqlite:///{path}")
    with sqlite3.connect(path) as again:
        assert again.execute("SELECT value FROM lease_celery_meta").fetchone() == (
            str(SCHEMA_VERSION),)
        indexes = {name for (name,) in again.execute(
            "SELECT name FROM sqlite_master WHERE type = 'index'")}
    assert indexes >= MIGRATED_INDEXES, indexes


#: Schema 8's one addition (every step only adds): a store of schema 7 is a current one
#: without it, and with version 7 recorded.
STATE_INDEX = "lease_celery_effects_state"

#: The indexes every migrated store has: the sweeper's, retention's, the limit groups'
#: (schema 6), the operator reads' (schema 7) and the receipts' state index (schema 8).
MIGRATED_INDEXES = {"lease_celery_leases_sweep", "lease_celery_leases_terminal",
                    "lease_celery_leases_slots", "lease_celery_leases_live",
                    "lease_celery_leases_dead", STATE_INDEX}


def check_schema_7_migrated(url: str, run: Callable[[str], list[Any]], *, drop_index: str,
                            list_indexes: str) -> None:
    """A store of schema 7 with a receipt in the reconcile queue, opened by this lease_celery:
    migrated in place (the state index made, version 8 recorded), the receipt kept and found
    by its state. ``run``: a statement on the store's database, its rows back."""
    with open_store(url) as store:
        assert store.effect_insert("queued", "f" * 64, None)
        receipt = store.effect_get("queued")
        assert receipt is not None and store.effect_update(
            "queued", version=receipt.version, state=EffectState.NEEDS_RECONCILIATION,
            result=None)
    run(drop_index)
    run("UPDATE lease_celery_meta SET value = '7' WHERE name = 'schema_version'")
    assert STATE_INDEX not in {row[0] for row in run(list_indexes)}
    with open_store(url) as store:
        queue = store.effects.find(EffectState.NEEDS_RECONCILIATION)
        assert [(r.key, r.version) for r in queue] == [("queued", receipt.version + 1)]
    assert STATE_INDEX in {row[0] for row in run(list_indexes)}
    assert run("SELECT value FROM lease_celery_meta WHERE name = 'schema_version'") == [
        (str(SCHEMA_VERSION),)]


def test_sqlite_schema_7_is_migrated(sqlite_url: str) -> None:
    path = sqlite_url.removeprefix("sqlite:///")

    def run(statement: str) -> list[Any]:
        with contextlib.closing(sqlite3.connect(path)) as conn, conn:
            return conn.execute(statement).fetchall()

    check_schema_7_migrated(sqlite_url, run, drop_index=f"DROP INDEX {STATE_INDEX}",
                            list_indexes="SELECT name FROM sqlite_master WHERE type = 'index'")


def test_postgres_schema_7_is_migrated(postgres_url: str) -> None:
    import psycopg

    schema = postgres_url.split("schema=")[1]

    def run(statement: str) -> list[Any]:
        with psycopg.connect(PG_DSN, autocommit=True) as conn:
            conn.execute(f'SET search_path TO "{schema}"')
            cursor = conn.execute(statement)
            return cursor.fetchall() if cursor.description else []

    check_schema_7_migrated(
        postgres_url, run, drop_index=f"DROP INDEX {STATE_INDEX}",
        list_indexes="SELECT indexname FROM pg_indexes WHERE schemaname = current_schema()")


def test_mysql_schema_7_is_migrated(mysql_url: str) -> None:
    from tests.support.mysql_databases import server_connection

    def run(statement: str) -> list[Any]:
        conn = server_connection()
        try:
            with conn.cursor() as cursor:
                cursor.execute(f"USE `{mysql_url.rsplit('/', 1)[1]}`")
                cursor.execute(statement)
                return list(cursor.fetchall())
        finally:
            conn.close()

    check_schema_7_migrated(
        mysql_url, run, drop_index=f"DROP INDEX {STATE_INDEX} ON lease_celery_effects",
        list_indexes="SELECT index_name FROM information_schema.statistics "
                     "WHERE table_schema = DATABASE()")


@pytest.fixture
def old_postgres() -> Iterator[str]:
    reachable, detail = postgres_reachable()
    require("PostgreSQL", reachable, detail)
    import psycopg

    schema = f"lease_old_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(PG_DSN, autocommit=True) as conn:
        conn.execute(f'CREATE SCHEMA "{schema}"')
        for statement in PG_SCHEMA_1.format(s=f'"{schema}"').split(";"):
            if statement.strip():
                conn.execute(statement)
        conn.execute(f'CREATE SEQUENCE "{schema}".lease_celery_fence')
        for row in ROWS:
            conn.execute(f'INSERT INTO "{schema}".lease_celery_leases (key, state, owner, '
                         "token, expires_at, result, updated_at, task) VALUES "
                         "(%s, %s, %s, %s, %s, %s, %s, %s)", (*row, TASK))
    yield f"{PG_DSN}?schema={schema}"
    with psycopg.connect(PG_DSN, autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def test_postgres_schema_1_is_migrated(old_postgres: str) -> None:
    import psycopg

    check_migrated(old_postgres)
    schema = old_postgres.split("schema=")[1]
    with psycopg.connect(PG_DSN, autocommit=True) as conn:
        row = conn.execute(f'SELECT value FROM "{schema}".lease_celery_meta').fetchone()
        indexes = conn.execute("SELECT indexname FROM pg_indexes WHERE schemaname = %s",
                               (schema,)).fetchall()
    assert row == (str(SCHEMA_VERSION),)
    assert {name for (name,) in indexes} >= MIGRATED_INDEXES, indexes
