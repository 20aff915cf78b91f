"""``django://ALIAS``: the lease store in a Django project's database.

The URL names a ``DATABASES`` alias; the store is the SQL store of that database's engine
(``PostgresStore``, ``MySQLStore`` or ``SQLiteStore``: their statements and rules, unchanged),
on connections made from the alias's settings (by Django's backend, where it can), so the
project's settings (host, options, ``init_command``, time zone) apply and there is nothing to
configure twice.

The store keeps its connections itself, per process (a forked child makes its own), and
never uses the ORM's per-thread connection: a lease write must commit on its own, not join
whatever transaction the calling thread has open, and the library's own threads (the
heartbeat's renewals, the sender's finishes) would otherwise each leave a Django connection
open that nothing closes. Migrations own the schema (``manage.py migrate``); the store
checks the version and refuses to run on a database that has not been migrated.
"""

from __future__ import annotations

from ...errors import ConfigError
from ...stores.base import Clock, Store
from .config import MYSQL_OPTIONS, PG_OPTIONS, SQLITE_OPTIONS, parse_url

__all__ = ["DjangoStore"]

class DjangoStore:
    """The store of ``django://ALIAS``: a ``DjangoPostgresStore``, ``DjangoMySQLStore`` or
    ``DjangoSQLiteStore``, chosen by the alias's engine (``open_store`` builds this class; it
    answers the right one).
    """

    # A factory in the registry's shape (``Class(url, clock=...)``): the store class depends
    # on the alias's engine, which only Django's settings know.
    def __new__(cls, url: str, *, clock: Clock | None = None) -> Store:  # type: ignore[misc]
        from django.db import connections

        alias, options = parse_url(url)
        try:
            vendor = connections[alias].vendor
        except Exception as exc:  # ConnectionDoesNotExist, ImproperlyConfigured
            raise ConfigError(f"django store URL {url!r}: {exc}") from exc
        if vendor == "postgresql":
            unknown = sorted(set(options) - set(PG_OPTIONS))
            from .postgres import DjangoPostgresStore as klass
        elif vendor == "sqlite":
            unknown = sorted(set(options) - set(SQLITE_OPTIONS))
            from .sqlite import DjangoSQLiteStore as klass  # type: ignore[assignment]
        elif vendor == "mysql":  # MySQL and MariaDB alike (the store runs on MariaDB)
            unknown = sorted(set(options) - set(MYSQL_OPTIONS))
            from .mysql import DjangoMySQLStore as klass  # type: ignore[assignment]
        else:
            raise ConfigError(f"django store URL {url!r}: Django database {alias!r} is "
                              f"{vendor}; the lease store runs on PostgreSQL, MariaDB and "
                              "SQLite")
        if unknown:
            raise ConfigError(f"django store URL {url!r}: option(s) {', '.join(unknown)} do "
                              f"not apply to a {vendor} database")
        return klass(url, clock=clock)

    @classmethod
    def check_url(cls, url: str) -> None:
        """The URL's form (the alias itself is checked when the store opens)."""
        parse_url(url)
