"""``django://ALIAS`` on SQLite: ``SQLiteStore`` on the alias's database file."""

from __future__ import annotations

import os
import sqlite3
from urllib.parse import quote, urlencode

from ...errors import ConfigError
from ...stores.sqlite import SQLiteStore, stored_schema_version
from .config import check_version, parse_url

__all__ = ["DjangoSQLiteStore"]


class DjangoSQLiteStore(SQLiteStore):
    """``SQLiteStore`` (its statements, write transactions and busy retries, unchanged) on
    the file of a ``DATABASES`` alias, read from Django's settings when the store opens (in
    a test run: the test database). URL options: ``busy_timeout``, ``synchronous``.

    The store opens the file itself, with the connection settings its rules need (no
    implicit transactions, its own busy handling), rather than through Django's backend,
    whose connection converts column types and waits for locks on its own."""

    @classmethod
    def _parse(cls, url: str, *, check_paths: bool = True) -> tuple[str, float, str]:
        from django.db import connections

        alias, options = parse_url(url)
        name = str(connections[alias].settings_dict["NAME"])
        if name == ":memory:" or "mode=memory" in name or name.startswith("file::memory:"):
            raise ConfigError(f"Django database {alias!r} is an in-memory SQLite database; "
                              "the lease store needs a file that every worker process opens"
                              " (for tests: DATABASES[...]['TEST']['NAME'] a file)")
        # SQLiteStore's own URL parsing checks the options and the directory.
        query = urlencode({name: value for name, value in options.items()
                           if name in ("busy_timeout", "synchronous")})
        return super()._parse(f"sqlite:///{quote(os.path.abspath(name))}?{query}",
                                  check_paths=check_paths)

    @property
    def alias(self) -> str:
        return parse_url(self.url)[0]

    def _create_schema(self, conn: sqlite3.Connection) -> None:
        # The schema is the migrations': checked, never made here.
        check_version(stored_schema_version(conn), self.alias)
