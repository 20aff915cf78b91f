"""The app's own tables, in the lease store's database (the ``app-tx`` and ``enqueue-tx``
variants): the same SQLite file, the same PostgreSQL schema.

- ``chaos_app_rows``: one row per body whose transaction committed (job, the lease token it
  committed under, pid, task id). The checker wants exactly one per done key.
- ``chaos_orders``: one row per order a publisher committed, with its job's task id. Its key's
  lease row is written in the same transaction (``lease_transaction=conn``).

Workers reach PostgreSQL as they reach the store, through the run's proxy and under its
``application_name``, so the ``conn`` fault kills the app's connections too and ``slow``
delays them. The harness and the publishers connect directly. Each side uses both kinds of
connection the lease writes through: the driver's own (``sqlite3``, psycopg 3) and
SQLAlchemy's (a ``Connection`` in the bodies, a ``Session`` in the publishers).
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, urlsplit

__all__ = ["APP_ROWS", "ORDERS", "AppDatabase"]

APP_ROWS = "chaos_app_rows"
ORDERS = "chaos_orders"


@dataclass(frozen=True)
class AppDatabase:
    """Where the app's tables live, read from a lease store URL of the run."""

    dialect: str  # "sqlite" | "postgres"
    target: str  # the SQLite file, or the PostgreSQL DSN without the store's options
    schema: str | None = None
    application_name: str | None = None

    @classmethod
    def of(cls, store_url: str) -> AppDatabase:
        if store_url.startswith("sqlite:///"):
            return cls("sqlite", store_url.removeprefix("sqlite:///"))
        if store_url.startswith("postgresql://"):
            parts = urlsplit(store_url)
            query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
            return cls("postgres", f"postgresql://{parts.netloc}{parts.path}",
                       schema=query.get("schema"),
                       application_name=query.get("application_name"))
        raise ValueError(f"the app's tables need a SQL store (sqlite, postgres): {store_url!r}")

    @property
    def mark(self) -> str:
        """The driver's parameter mark."""
        return "?" if self.dialect == "sqlite" else "%s"

    def table(self, name: str) -> str:
        return name if self.schema is None else f'"{self.schema}".{name}'

    def connect(self) -> Any:
        """A new driver connection (sqlite3, psycopg 3), no transaction open."""
        if self.dialect == "sqlite":
            # A long busy timeout: a body's transaction holds the file's write lock, and a
            # stopped body (the ``stop`` fault) holds it for a few seconds.
            return sqlite3.connect(self.target, timeout=30)
        import psycopg

        return psycopg.connect(self.target, connect_timeout=5,
                               application_name=self.application_name or "chaos")

    def engine(self) -> Any:
        """A SQLAlchemy engine on the same database (no pool: a broken connection is dropped
        with the ``Connection`` that had it)."""
        import sqlalchemy

        if self.dialect == "sqlite":
            return sqlalchemy.create_engine(f"sqlite:///{self.target}",
                                            poolclass=sqlalchemy.NullPool,
                                            connect_args={"timeout": 30})
        return sqlalchemy.create_engine(
            "postgresql+psycopg://" + self.target.removeprefix("postgresql://"),
            poolclass=sqlalchemy.NullPool,
            connect_args={"connect_timeout": 5,
                          "application_name": self.application_name or "chaos"})

    def create_tables(self) -> None:
        """Made by the harness once the store made its schema (before any worker starts)."""
        conn = self.connect()
        try:
            conn.execute(f"CREATE TABLE IF NOT EXISTS {self.table(APP_ROWS)} "
                         "(job TEXT NOT NULL, token INTEGER NOT NULL, pid INTEGER, task_id TEXT)")
            conn.execute(f"CREATE TABLE IF NOT EXISTS {self.table(ORDERS)} "
                         "(job TEXT PRIMARY KEY, task_id TEXT NOT NULL)")
            conn.commit()
        finally:
            conn.close()

    def insert_app_row(self, conn: Any, job: str, token: int, pid: int, task_id: str) -> None:
        _write(conn, f"INSERT INTO {self.table(APP_ROWS)} (job, token, pid, task_id) "
               f"VALUES ({self.mark}, {self.mark}, {self.mark}, {self.mark})",
               (job, token, pid, task_id))

    def insert_order(self, conn: Any, job: str, task_id: str) -> None:
        _write(conn, f"INSERT INTO {self.table(ORDERS)} (job, task_id) "
               f"VALUES ({self.mark}, {self.mark})", (job, task_id))

    def read(self) -> tuple[dict[str, list[dict[str, Any]]], dict[str, str]]:
        """Every committed app row (job -> rows) and order (job -> task id)."""
        conn = self.connect()
        try:
            rows: dict[str, list[dict[str, Any]]] = {}
            for job, token, pid, task_id in conn.execute(
                    f"SELECT job, token, pid, task_id FROM {self.table(APP_ROWS)} "
                    "ORDER BY job, token").fetchall():
                rows.setdefault(job, []).append({"token": token, "pid": pid,
                                                 "task_id": task_id})
            orders = dict(conn.execute(
                f"SELECT job, task_id FROM {self.table(ORDERS)}").fetchall())
        finally:
            conn.close()
        return rows, orders


def _write(conn: Any, sql: str, params: tuple[Any, ...]) -> None:
    """One statement in ``conn``'s open transaction, whatever kind of connection it is."""
    if hasattr(conn, "get_bind"):  # a SQLAlchemy Session: its connection, its transaction
        conn.connection().exec_driver_sql(sql, params)
    elif hasattr(conn, "exec_driver_sql"):  # a SQLAlchemy Connection
        conn.exec_driver_sql(sql, params)
    else:
        conn.execute(sql, params)
