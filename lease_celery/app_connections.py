"""The app's own database connection, as lease_celery writes through it.

A SQL lease store that lives in the app's database (the same PostgreSQL database, the same
SQLite file) can write a key's finish, or its row at publish, inside the app's open
transaction: the app's rows and the lease's commit together or not at all
(``LeaseHandle.transaction``, ``apply_async(..., lease_transaction=conn)``).

``app_connection`` wraps what the app holds: a psycopg 3 connection, a ``sqlite3``
connection, or a SQLAlchemy ``Connection`` or ``Session``. Another integration (Django's
connection, ``lease_celery.contrib``) passes its own ``AppConnection``. The wrapper only runs
statements and moves the transaction the caller left to it; the statements are the store's.
"""

from __future__ import annotations

import contextlib
import sqlite3
import sys
import weakref
from typing import Any, Protocol, runtime_checkable

from .errors import ConfigError

__all__ = ["AppConnection", "CheckedConnections", "app_connection"]

#: SQLAlchemy's dialect names, as the stores name their dialects.
_DIALECTS = {"postgresql": "postgres", "sqlite": "sqlite", "mysql": "mysql", "mariadb": "mysql"}


@runtime_checkable
class AppConnection(Protocol):
    """One connection of the app's, in the store's terms."""

    #: ``postgres``, ``sqlite`` or ``mysql``: which store's statements it runs.
    dialect: str
    #: What the caller handed over (its identity keys the outbox of its transaction).
    raw: Any

    @property
    def in_transaction(self) -> bool:
        """Is a transaction open on it now?"""

    @property
    def opens_on_write(self) -> bool:
        """Does a write open a transaction that the caller then commits (the driver's implicit
        BEGIN), rather than committing at once (autocommit)?"""

    def execute(self, sql: str, params: dict[str, Any]) -> list[tuple[Any, ...]]:
        """Run one statement of the store's (its dialect's parameter style); its rows."""

    def changed(self, sql: str, params: dict[str, Any]) -> int:
        """Run one write of the store's; how many rows it changed."""

    def begin(self) -> None:
        """Open a transaction that lease_celery then commits or rolls back itself."""

    def commit(self) -> None: ...

    def rollback(self) -> None: ...


def app_connection(connection: Any) -> AppConnection:
    """``connection`` as an ``AppConnection``; ``ConfigError`` naming its type when it is
    none of those lease_celery can write through."""
    if isinstance(connection, AppConnection):
        return connection
    if isinstance(connection, sqlite3.Connection):
        return _Sqlite3(connection)
    psycopg = sys.modules.get("psycopg")  # imported by the app if it holds such a connection
    if psycopg is not None and isinstance(connection, psycopg.Connection):
        return _Psycopg(connection)
    pymysql = sys.modules.get("pymysql.connections")
    if pymysql is not None and isinstance(connection, pymysql.Connection):
        return _PyMySQL(connection)
    sqlalchemy_orm = sys.modules.get("sqlalchemy.orm")
    sqlalchemy_engine = sys.modules.get("sqlalchemy.engine")
    if sqlalchemy_orm is not None and isinstance(connection, sqlalchemy_orm.Session):
        return _SqlAlchemySession(connection)
    if sqlalchemy_engine is not None and isinstance(connection, sqlalchemy_engine.Connection):
        return _SqlAlchemyConnection(connection)
    raise ConfigError(
        f"lease_celery cannot write through a {type(connection).__module__}."
        f"{type(connection).__qualname__}: pass a psycopg 3, PyMySQL or sqlite3 connection, "
        "or a SQLAlchemy Connection or Session to the lease store's own database")


def _rows(cursor: Any) -> list[tuple[Any, ...]]:
    return [tuple(row) for row in cursor.fetchall()] if cursor.description else []


class _Sqlite3:
    dialect = "sqlite"

    def __init__(self, connection: sqlite3.Connection) -> None:
        self.raw = connection

    @property
    def in_transaction(self) -> bool:
        return self.raw.in_transaction

    @property
    def opens_on_write(self) -> bool:
        return self.raw.isolation_level is not None  # sqlite3's implicit BEGIN before DML

    def execute(self, sql: str, params: dict[str, Any]) -> list[tuple[Any, ...]]:
        return _rows(self.raw.execute(sql, params))

    def changed(self, sql: str, params: dict[str, Any]) -> int:
        return int(self.raw.execute(sql, params).rowcount)

    def begin(self) -> None:
        # IMMEDIATE: the write lock from the start, so that the lease checked now stays
        # checked (no claim can commit in between), as BEGIN IMMEDIATE does in the store.
        self.raw.execute("BEGIN IMMEDIATE")

    def commit(self) -> None:
        self.raw.commit()

    def rollback(self) -> None:
        self.raw.rollback()


class _Psycopg:
    dialect = "postgres"

    def __init__(self, connection: Any) -> None:
        self.raw = connection
        self._owned: Any = None  # the psycopg Transaction lease_celery opened

    @property
    def in_transaction(self) -> bool:
        from psycopg.pq import TransactionStatus
        return bool(self.raw.info.transaction_status != TransactionStatus.IDLE)

    @property
    def opens_on_write(self) -> bool:
        return not self.raw.autocommit

    def execute(self, sql: str, params: dict[str, Any]) -> list[tuple[Any, ...]]:
        cursor = self.raw.cursor()  # a plain cursor: the app's row factory is the app's
        try:
            cursor.execute(sql, params)
            return _rows(cursor)
        finally:
            cursor.close()

    def changed(self, sql: str, params: dict[str, Any]) -> int:
        cursor = self.raw.cursor()
        try:
            cursor.execute(sql, params)
            return int(cursor.rowcount)
        finally:
            cursor.close()

    def begin(self) -> None:
        self._owned = self.raw.transaction()
        self._owned.__enter__()

    def commit(self) -> None:
        owned, self._owned = self._owned, None
        owned.__exit__(None, None, None)

    def rollback(self) -> None:
        from psycopg import Rollback
        owned, self._owned = self._owned, None
        owned.__exit__(Rollback, Rollback(), None)


class _PyMySQL:
    dialect = "mysql"

    def __init__(self, connection: Any) -> None:
        self.raw = connection

    @property
    def in_transaction(self) -> bool:
        from pymysql.constants import SERVER_STATUS

        return bool(self.raw.server_status & SERVER_STATUS.SERVER_STATUS_IN_TRANS)

    @property
    def opens_on_write(self) -> bool:
        return not self.raw.get_autocommit()

    def _cursor(self) -> Any:
        from pymysql.cursors import Cursor

        return self.raw.cursor(Cursor)  # tuples: the app's cursor class is the app's

    def execute(self, sql: str, params: dict[str, Any]) -> list[tuple[Any, ...]]:
        with self._cursor() as cursor:
            cursor.execute(sql, params)
            return _rows(cursor)

    def changed(self, sql: str, params: dict[str, Any]) -> int:
        with self._cursor() as cursor:
            return int(cursor.execute(sql, params))

    def begin(self) -> None:
        self.raw.begin()

    def commit(self) -> None:
        self.raw.commit()

    def rollback(self) -> None:
        self.raw.rollback()


class _SqlAlchemyConnection:
    def __init__(self, connection: Any) -> None:
        self.raw = connection
        self.dialect = _dialect_of(connection.dialect.name)
        self._owned: Any = None

    @property
    def in_transaction(self) -> bool:
        return bool(self.raw.in_transaction())

    @property
    def opens_on_write(self) -> bool:
        return True  # SQLAlchemy 2 begins on first use ("autobegin")

    def execute(self, sql: str, params: dict[str, Any]) -> list[tuple[Any, ...]]:
        # exec_driver_sql: the statement goes to the driver as written, in its own
        # parameter style, which is the style the store's statements are written in.
        result = self._connection().exec_driver_sql(sql, params)
        return [tuple(row) for row in result] if result.returns_rows else []

    def changed(self, sql: str, params: dict[str, Any]) -> int:
        return int(self._connection().exec_driver_sql(sql, params).rowcount)

    def _connection(self) -> Any:
        return self.raw

    def begin(self) -> None:
        self._owned = self.raw.begin()

    def commit(self) -> None:
        owned, self._owned = self._owned, None
        owned.commit()

    def rollback(self) -> None:
        owned, self._owned = self._owned, None
        owned.rollback()


class _SqlAlchemySession(_SqlAlchemyConnection):
    def __init__(self, session: Any) -> None:
        self.raw = session
        self.dialect = _dialect_of(session.get_bind().dialect.name)
        self._owned = None

    def _connection(self) -> Any:
        return self.raw.connection()  # the Session's connection, in its transaction


def _dialect_of(name: str) -> str:
    try:
        return _DIALECTS[name]
    except KeyError:
        raise ConfigError(f"lease_celery has no lease store on SQLAlchemy's {name!r} "
                          "dialect") from None


class CheckedConnections:
    """The app's connections a store has checked reach its own database, so that the check
    (a round trip) is made once per connection, not once per transaction. Held weakly: a
    closed connection's place is not taken by a new one with its id."""

    def __init__(self) -> None:
        self._seen: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()

    def __contains__(self, conn: AppConnection) -> bool:
        try:
            return conn.raw in self._seen
        except TypeError:  # not weakly referable: checked every time
            return False

    def add(self, conn: AppConnection) -> None:
        with contextlib.suppress(TypeError):  # not weakly referable: checked every time
            self._seen[conn.raw] = True
