"""``django://ALIAS`` on PostgreSQL: ``PostgresStore`` on connections Django's backend makes."""

from __future__ import annotations

from typing import Any

import psycopg

from ...checks import check_ttl
from ...errors import ConfigError
from ...stores.base import Clock
from ...stores.pg_connections import Connections
from ...stores.postgres import PostgresStore, stored_schema_version
from ...stores.urls import number_option, whole_option
from .config import check_version, parse_url
from .schema import lease_schema

__all__ = ["DjangoPostgresStore"]


class DjangoPostgresStore(PostgresStore):
    """``PostgresStore`` (its statements, retries and pool, unchanged) whose connections
    are made by Django's backend for a ``DATABASES`` alias, in the schema the migrations made
    (``LEASE_CELERY_SCHEMA``). URL options: ``pool_max``, ``reconnect_timeout``."""

    def __init__(self, url: str, *, clock: Clock | None = None) -> None:
        self.url = url
        self._clock = clock
        self.alias, options = parse_url(url)
        self._where = f"Django database {self.alias!r}"
        self.schema = lease_schema()
        self.pool_max = whole_option("django", "pool_max", options.get("pool_max", "4"),
                                     minimum=1)
        self.reconnect_timeout = check_ttl(
            number_option(url, "reconnect_timeout", options.get("reconnect_timeout"), 10.0),
            name="django reconnect_timeout")
        self._prepare()

    def _connect(self) -> psycopg.Connection[Any]:
        """A new autocommit connection from Django's backend for the alias: its settings,
        its connection setup (time zone, role, ``connection_created`` receivers), its driver."""
        from django.db import connections

        # A DatabaseWrapper of the store's own, not the thread's: only its driver
        # connection is kept (and closed by the store's pool).
        wrapper = connections.create_connection(self.alias)
        if wrapper.settings_dict.get("OPTIONS", {}).get("pool"):
            # Django's pool lends connections to be given back to it: the store keeps its
            # own, so it connects with the pool's parameters, but not through it.
            conn = psycopg.connect(**wrapper.get_connection_params())
        else:
            wrapper.connect()  # the driver's errors (OperationalError) as they are: retried
            conn = wrapper.connection
        if not isinstance(conn, psycopg.Connection):
            conn.close()
            raise ConfigError(f"Django database {self.alias!r} uses {type(conn).__module__}; "
                              "the django:// lease store on PostgreSQL needs psycopg 3 "
                              "(pip install 'psycopg[binary]'; Django picks it over psycopg2)")
        # The store's statements are written for READ COMMITTED (the default), each its own
        # commit; a project's OPTIONS["isolation_level"] is for its own transactions.
        conn.isolation_level = psycopg.IsolationLevel.READ_COMMITTED
        conn.autocommit = True
        return conn

    def _open_connections(self) -> Connections:
        connections = Connections("", max_size=self.pool_max, connect=self._connect)
        with connections.connection(self.reconnect_timeout) as conn:
            # The schema is the migrations': checked, never made here.
            check_version(stored_schema_version(conn, self._q), self.alias)
        return connections
