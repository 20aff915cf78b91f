"""``django://ALIAS`` on MariaDB: ``MySQLStore`` on connections made from the alias's settings.

Django's MySQL backend connects with mysqlclient (or PyMySQL posing as it); the store's own
connections are PyMySQL's whatever the project's driver is, since its statements, retries
and pool are written for PyMySQL (its errors, its multi-statement claim batch). They are
made with the alias's HOST, PORT, USER, PASSWORD, NAME and OPTIONS, so there is nothing to
configure twice. ``self.lease.atomic()`` runs on Django's own connection (its driver).
"""

from __future__ import annotations

import inspect
from typing import Any
from urllib.parse import quote, urlencode

from ...errors import ConfigError
from ...stores.base import Clock
from ...stores.mysql import MySQLStore
from ...stores.mysql_schema import stored_schema_version
from .config import MYSQL_OPTIONS, check_version, parse_url

__all__ = ["DjangoMySQLStore"]

#: OPTIONS that are the project's session, not the store's: the store's sessions are READ
#: COMMITTED (its statements' rules) and utf8mb4 (a key or a result may hold any character;
#: the lease tables are utf8mb4), whatever the project's own connections use.
_PROJECT_ONLY = ("isolation_level", "charset", "use_unicode")


def _pymysql_parameters() -> set[str]:
    import pymysql

    return set(inspect.signature(pymysql.connections.Connection.__init__).parameters) - {
        "self"}


class DjangoMySQLStore(MySQLStore):
    """``MySQLStore`` (its statements, retries and pool, unchanged) on the database of a
    ``DATABASES`` alias, checked (never made) at the schema the migrations made. URL options:
    ``pool_max``, ``reconnect_timeout``, ``lock_wait_timeout``, ``connect_timeout``."""

    def __init__(self, url: str, *, clock: Clock | None = None) -> None:
        from django.db import connections

        self.alias, options = parse_url(url)
        settings = connections[self.alias].settings_dict
        # MySQLStore parses its options from a URL of its own; the address is set below from
        # the settings (a password or a socket path need no quoting there).
        query = urlencode({name: options[name] for name in MYSQL_OPTIONS if name in options})
        super().__init__(f"mysql://localhost/{quote(str(settings['NAME']), safe='')}?{query}",
                         clock=clock)
        self.url = url
        self._where = f"Django database {self.alias!r}"
        self._connect_args.update(_connection_args(self.alias, settings))

    def _make_schema(self, conn: Any, queries: dict[str, str]) -> None:
        # The schema is the migrations': checked, never made here.
        with conn.cursor() as cur:
            check_version(stored_schema_version(cur, queries), self.alias)


def _connection_args(alias: str, settings: dict[str, Any]) -> dict[str, Any]:
    """PyMySQL's ``connect()`` arguments for the alias, as Django's backend reads them."""
    args: dict[str, Any] = {"user": settings.get("USER") or "",
                            "password": settings.get("PASSWORD") or ""}
    # An empty HOST: mysqlclient connects through the client library's default socket, but
    # PyMySQL knows no such default and connects to localhost over TCP (docs/django.md).
    host = settings.get("HOST") or "localhost"
    if host.startswith("/"):  # Django's way of naming a socket
        args["unix_socket"] = host
    else:
        args["host"] = host
    if settings.get("PORT"):
        args["port"] = int(settings["PORT"])
    options = {name: value for name, value in (settings.get("OPTIONS") or {}).items()
               if name not in _PROJECT_ONLY}
    unknown = sorted(set(options) - _pymysql_parameters())
    if unknown:
        raise ConfigError(f"Django database {alias!r}: the lease store connects with "
                          f"PyMySQL, which has no parameter {', '.join(unknown)} of OPTIONS "
                          "(mysqlclient's own, or misspelled; a read_default_file can carry "
                          "the client settings both read)")
    # init_command runs before the store's own session settings, which therefore win.
    args.update(options)
    return args
