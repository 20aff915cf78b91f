"""``django://ALIAS`` on PostgreSQL: ``PostgresStore`` on connections Django's backend makes."""

from __future__ import annotations

from typing import Any

import psycopg
import psycopg.sql

from ...checks import check_ttl
from ...stores.base import Clock
from ...stores.pg_connections import Connections
from ...stores.postgres import PostgresStore, stored_schema_version
from ...stores.urls import number_option, whole_option
from .config import check_version, parse_url
from .schema import lease_schema

__all__ = ["DjangoPostgresStore"]

#: Connection parameters of Django's psycopg2 backend that are psycopg2's own, not libpq's.
_PSYCOPG2_ONLY = ("cursor_factory",)


def _psycopg_parameters(wrapper: Any) -> dict[str, Any]:
    """``psycopg.connect()`` arguments from Django's backend for the alias (on psycopg 3 or
    psycopg2: the settings' libpq parameters are the same)."""
    params = dict(wrapper.get_connection_params())
    if wrapper.Database is not psycopg:
        for name in _PSYCOPG2_ONLY:
            params.pop(name, None)
    return params


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
        """A new autocommit psycopg 3 connection for the alias: its settings, and, where
        Django's backend can make it (psycopg 3, no pool), its connection setup too (time
        zone, role, ``connection_created`` receivers)."""
        from django.db import connections

        # A DatabaseWrapper of the store's own, not the thread's: only its driver
        # connection is kept (and closed by the store's pool).
        wrapper = connections.create_connection(self.alias)
        if wrapper.settings_dict.get("OPTIONS", {}).get("pool") or wrapper.Database is not psycopg:
            # Django's pool lends connections to be given back to it, and a project on
            # psycopg2 makes psycopg2 connections, on which the store's statements and pool do
            # not run (psycopg 3's API): the store connects itself, psycopg 3 with the
            # parameters Django's backend reads from the settings.
            conn = psycopg.connect(**_psycopg_parameters(wrapper))
            role = wrapper.settings_dict.get("OPTIONS", {}).get("assume_role")
            if role:
                conn.execute(psycopg.sql.SQL("SET ROLE {}").format(psycopg.sql.Identifier(role)))
        else:
            wrapper.connect()  # the driver's errors (OperationalError) as they are: retried
            conn = wrapper.connection
        # The store's statements are written for READ COMMITTED (the default), each its own
        # commit; a project's OPTIONS["isolation_level"] is for its own transactions.
        conn.isolation_level = psycopg.IsolationLevel.READ_COMMITTED
        conn.autocommit = True
        return conn

    def _open_connections(self) -> Connections:
        connections = Connections("", max_size=self.pool_max, connect=self._connect)
        try:
            with connections.connection(self.reconnect_timeout) as conn:
                # The schema is the migrations': checked, never made here.
                check_version(stored_schema_version(conn, self._q), self.alias)
        except psycopg.Error as exc:
            # As PostgresStore's own opening: a connection lost right now (killed, a restart)
            # is the store's error, which the task's gate defers as an outage; the driver's
            # error would fail the task and leave its key without a row.
            connections.close()
            raise self._error(exc) from exc
        return connections
