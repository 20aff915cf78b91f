"""Databases for the MySQL store's tests, one per test, pooled.

A database of its own per test isolates it as a PostgreSQL schema or a Redis prefix does,
but making one and the store's tables, indexes and triggers in it (then dropping it) costs
about 0.25 s of a server shared with the other test processes. So a test returns its database
emptied instead (its rows deleted, the fence sequence restarted: ~5 ms), and the next test of
the process takes it; a database a test left in any other shape (a table of its own, another
schema version) is dropped.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlsplit

import pymysql

from lease_celery.stores.sql_glue import SCHEMA_VERSION
from tests.support.servers import MYSQL_URL

__all__ = ["database", "server_connection"]

#: The store's tables, in the order they are emptied.
TABLES = ("lease_celery_leases", "lease_celery_history", "lease_celery_effects",
          "lease_celery_limits", "lease_celery_waiters", "lease_celery_meta")
_pool: list[str] = []


def server_connection() -> Any:
    parts = urlsplit(MYSQL_URL)
    return pymysql.connect(host=parts.hostname or "127.0.0.1", port=parts.port or 3306,
                           user=parts.username or "root", password=parts.password or "",
                           autocommit=True, connect_timeout=3)


@contextmanager
def database() -> Iterator[str]:
    """A store URL on an empty database of this test's own."""
    name = _pool.pop() if _pool else f"lease_t_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    conn = server_connection()
    try:
        with conn.cursor() as cur:
            cur.execute(f"CREATE DATABASE IF NOT EXISTS `{name}`")
        yield f"{MYSQL_URL}/{name}"
        with conn.cursor() as cur:
            if _empty(cur, name):
                _pool.append(name)
            else:
                cur.execute(f"DROP DATABASE IF EXISTS `{name}`")
    finally:
        conn.close()


def _empty(cur: Any, name: str) -> bool:
    """Empty ``name`` for the next test, if it holds nothing but a current store's tables."""
    cur.execute("SELECT table_name FROM information_schema.tables WHERE table_schema = %s",
                (name,))
    tables = {row[0] for row in cur.fetchall()}
    if not tables:
        return True
    if tables != {*TABLES, "lease_celery_fence"}:
        return False
    cur.execute(f"SELECT value FROM `{name}`.lease_celery_meta WHERE name = 'schema_version'")
    row = cur.fetchone()
    if row is None or int(row[0]) != SCHEMA_VERSION:
        return False
    for table in TABLES[:-1]:
        cur.execute(f"DELETE FROM `{name}`.`{table}`")
    cur.execute(f"ALTER SEQUENCE `{name}`.lease_celery_fence RESTART")
    return True


def drop_pool() -> None:
    """Drop the pooled databases (the end of the test process)."""
    if not _pool:
        return
    conn = server_connection()
    try:
        with conn.cursor() as cur:
            while _pool:
                cur.execute(f"DROP DATABASE IF EXISTS `{_pool.pop()}`")
    finally:
        conn.close()
