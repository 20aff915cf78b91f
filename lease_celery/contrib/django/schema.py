"""The store's schema in a Django database: made by the migrations with the store's own
statements (``stores.postgres.create_schema``, ``stores.sqlite.create_schema``,
``stores.mysql_schema.make_schema``), so the tables, indexes, triggers and the recorded schema
version are the ones a store opened on its own URL would make, and cannot drift from them."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ...errors import ConfigError

__all__ = ["CursorExecutes", "DictCursors", "create_store_schema", "lease_schema", "table_name"]

#: The PostgreSQL schema of the lease tables when ``LEASE_CELERY_SCHEMA`` is not set: the
#: PostgreSQL store's default too, so ``django://default`` and ``postgresql://...`` (a worker
#: without Django) open the same tables.
DEFAULT_SCHEMA = "public"


def lease_schema() -> str:
    """The PostgreSQL schema of the lease tables: ``settings.LEASE_CELERY_SCHEMA``."""
    from django.conf import settings

    schema = str(getattr(settings, "LEASE_CELERY_SCHEMA", DEFAULT_SCHEMA))
    if not schema.replace("_", "").isalnum():
        raise ConfigError(f"LEASE_CELERY_SCHEMA={schema!r} must be a plain identifier "
                          "(letters, digits, underscores)")
    return schema


def table_name(table: str) -> str:
    """A model's ``db_table`` for the lease table ``table``: schema-qualified on PostgreSQL
    when the tables live outside ``public`` (Django quotes the whole name; the inner quotes
    make it ``"schema"."table"``)."""
    try:
        schema = lease_schema()
    except Exception:  # settings not configured (docs build, import checks)
        schema = DEFAULT_SCHEMA
    return table if schema == DEFAULT_SCHEMA else f'{schema}"."{table}'


class CursorExecutes:
    """A Django cursor in the shape the store's schema function runs statements on
    (``execute(sql, params)`` answering something with ``fetchone``), whatever the driver
    (psycopg 3 or psycopg2)."""

    def __init__(self, cursor: Any) -> None:
        self.cursor = cursor

    def execute(self, query: str, params: dict[str, Any] | None = None) -> Any:
        self.cursor.execute(query, params)
        return self.cursor


def create_store_schema(schema_editor: Any) -> None:
    """The migration's step: the store's schema made or brought to this lease_celery's
    version, in the migration's transaction, on the database being migrated."""
    connection = schema_editor.connection
    if connection.vendor == "postgresql":
        from ...stores.postgres import create_schema, schema_queries

        schema = lease_schema()
        with connection.cursor() as cursor:
            create_schema(CursorExecutes(cursor), schema_queries(schema), schema,
                          f"Django database {connection.alias!r}")
    elif connection.vendor == "sqlite":
        from ...stores.sqlite import create_schema as create_sqlite_schema

        connection.ensure_connection()
        # The driver's own connection: the store's statements use sqlite3's :name
        # parameters, which Django's cursor would rewrite. It is in the migration's
        # transaction all the same.
        create_sqlite_schema(connection.connection, f"Django database {connection.alias!r}")
    elif connection.vendor == "mysql":
        from ...stores.mysql import schema_queries as mysql_queries
        from ...stores.mysql_schema import make_schema

        # MariaDB commits each DDL statement on its own: Django runs this migration outside
        # a transaction there, and the store's steps may each be run again.
        queries = mysql_queries(connection.mysql_server_info)
        make_schema(DictCursors(connection), queries, f"Django database {connection.alias!r}")
    else:
        raise ConfigError(f"lease_celery's tables cannot be made on {connection.vendor} "
                          f"(Django database {connection.alias!r}): PostgreSQL, MariaDB and "
                          "SQLite only")


class DictCursors:
    """A Django connection in the shape the MySQL store's schema function takes (PyMySQL's
    ``cursor()`` as a context manager, rows as dicts), whatever Django's MySQL driver."""

    def __init__(self, connection: Any) -> None:
        self.connection = connection

    @contextmanager
    def cursor(self) -> Iterator[_DictRows]:
        with self.connection.cursor() as cursor:
            yield _DictRows(cursor)


class _DictRows:
    def __init__(self, cursor: Any) -> None:
        self.cursor = cursor

    def execute(self, query: str, params: dict[str, Any] | None = None) -> None:
        self.cursor.execute(query, params)

    def fetchone(self) -> dict[str, Any] | None:
        row = self.cursor.fetchone()
        if row is None:
            return None
        return {column[0]: value for column, value in zip(self.cursor.description, row,
                                                            strict=True)}
