"""Connections of the app's own to a SQL lease store's database, in every form the lease can
write through (``lease_celery.app_connections``), and an app table beside the store's.

Each form is named by ``KINDS``; a store's dialect picks the driver. A new SQL store adds its
driver here, and every test that uses these runs on it.
"""

from __future__ import annotations

import sqlite3
from typing import Any

import pymysql

from lease_celery import Store

#: The forms of an app connection: the driver's own, a SQLAlchemy Connection, a Session.
KINDS = ["driver", "sqlalchemy", "session"]


def dialect(store: Store) -> str:
    scheme = store.url.split(":", 1)[0]
    return {"sqlite": "sqlite", "mysql": "mysql", "mariadb": "mysql"}.get(scheme, "postgres")


def sqlalchemy_url(store: Store) -> str:
    if dialect(store) == "sqlite":
        return f"sqlite:///{store.path}"  # type: ignore[attr-defined]
    if dialect(store) == "mysql":
        return "mysql+pymysql://" + store.url.split("://", 1)[1].split("?")[0]
    return "postgresql+psycopg://" + store.url.split("://", 1)[1].split("?")[0]


def table(store: Store, name: str = "app_rows") -> str:
    """The app table's name, in the store's schema on PostgreSQL (on MySQL the connection's
    database is the store's)."""
    if dialect(store) in ("sqlite", "mysql"):
        return name
    return f'"{store.schema}".{name}'  # type: ignore[attr-defined]


class _PyMySQLApp(pymysql.connections.Connection):  # type: ignore[misc]
    """The app's PyMySQL connection (what lease_celery wraps), with ``execute`` as the other
    drivers have it, for the tests' own statements."""

    def execute(self, sql: str, params: Any = None) -> Any:
        cursor = self.cursor()
        cursor.execute(sql, params)
        return cursor


def _mysql_app(store: Store) -> _PyMySQLApp:
    from urllib.parse import urlsplit

    from tests.support.servers import MYSQL_URL

    parts = urlsplit(MYSQL_URL)
    return _PyMySQLApp(host=parts.hostname or "127.0.0.1", port=parts.port or 3306,
                       user=parts.username or "root", password=parts.password or "",
                       database=store.database,  # type: ignore[attr-defined]
                       autocommit=False)


def connect(store: Store, kind: str) -> Any:
    """A fresh app connection of ``kind`` to ``store``'s database, no transaction open, with
    the app table made; close it with ``close``."""
    store.get("app-db:setup")  # the store makes its schema on first use: the table's home
    setup = f"CREATE TABLE IF NOT EXISTS {table(store)} (job TEXT, n INTEGER)"
    if kind == "driver":
        if dialect(store) == "sqlite":
            conn: Any = sqlite3.connect(store.path, timeout=10)  # type: ignore[attr-defined]
        elif dialect(store) == "mysql":
            conn = _mysql_app(store)
        else:
            import psycopg

            conn = psycopg.connect(store.url.split("?")[0])
        conn.execute(setup)
        conn.commit()
        return conn
    import sqlalchemy
    from sqlalchemy.orm import Session

    engine = sqlalchemy.create_engine(sqlalchemy_url(store), poolclass=sqlalchemy.NullPool)
    with engine.begin() as setup_conn:
        setup_conn.exec_driver_sql(setup)
    return engine.connect() if kind == "sqlalchemy" else Session(engine)


def insert(conn: Any, store: Store, job: str, n: int = 1) -> None:
    """One app row, through ``conn`` in whatever transaction it has open."""
    mark = "?" if dialect(store) == "sqlite" else "%s"
    sql = f"INSERT INTO {table(store)} (job, n) VALUES ({mark}, {mark})"
    if isinstance(conn, pymysql.connections.Connection) and not isinstance(conn, _PyMySQLApp):
        with conn.cursor() as cursor:  # the store's own (store.fenced()): no execute()
            cursor.execute(sql, (job, n))
    elif hasattr(conn, "get_bind"):  # a Session: its connection, in its transaction
        conn.connection().exec_driver_sql(sql, (job, n))
    elif hasattr(conn, "exec_driver_sql"):  # a SQLAlchemy Connection
        conn.exec_driver_sql(sql, (job, n))
    else:
        conn.execute(sql, (job, n))


def rows(store: Store, job: str) -> list[int]:
    """The committed app rows of ``job`` (read on a connection of its own)."""
    conn = connect(store, "driver")
    try:
        mark = "?" if dialect(store) == "sqlite" else "%s"
        found = conn.execute(f"SELECT n FROM {table(store)} WHERE job = {mark} ORDER BY n",
                             (job,)).fetchall()
    finally:
        conn.close()
    return [n for (n,) in found]


def close(conn: Any) -> None:
    conn.close()


class CommitReplyLost:
    """An app connection whose commit reaches the server and commits, and whose reply is then
    lost: the driver raises its ``OperationalError`` as a connection dropped right after the
    COMMIT went out would. Everything else is the wrapped connection's."""

    def __init__(self, connection: Any) -> None:
        from lease_celery.app_connections import app_connection

        self._inner = app_connection(connection)
        self.raw, self.dialect = self._inner.raw, self._inner.dialect

    @property
    def in_transaction(self) -> bool:
        return self._inner.in_transaction

    @property
    def opens_on_write(self) -> bool:
        return self._inner.opens_on_write

    def execute(self, sql: str, params: dict[str, Any]) -> list[tuple[Any, ...]]:
        return self._inner.execute(sql, params)

    def changed(self, sql: str, params: dict[str, Any]) -> int:
        return self._inner.changed(sql, params)

    def begin(self) -> None:
        self._inner.begin()

    def commit(self) -> None:
        self._inner.commit()
        if self.dialect == "sqlite":
            raise sqlite3.OperationalError("the reply to COMMIT was lost")
        import psycopg

        raise psycopg.OperationalError("server closed the connection unexpectedly")

    def rollback(self) -> None:
        self._inner.rollback()
