"""The Django project of tests/django_integration, set up once in this test process.

These tests configure Django with their own settings (project/settings.py), so they run in
a pytest of their own (.ci/run: LEASE_TEST_DJANGO=1 pytest tests/django_integration), never
beside tests/workers/test_beat_integrations.py, which sets Django up with others.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import psycopg
import pytest

from tests.support.servers import (
    PG_DSN,
    REDIS_URL,
    mysql_reachable,
    postgres_reachable,
    require,
)

#: The test process's databases: a SQLite file, a PostgreSQL and a MariaDB database of its
#: own.
RUN = uuid.uuid4().hex[:8]
PG_NAME = f"lease_django_{RUN}"
MYSQL_NAME = f"lease_django_{RUN}"
#: The aliases, each migrated: SQLite, PostgreSQL, MariaDB.
ALIASES = ("default", "pg", "my")


def _mysql(statement: str) -> None:
    from tests.support.mysql_databases import server_connection

    conn = server_connection()
    try:
        with conn.cursor() as cursor:
            cursor.execute(statement)
    finally:
        conn.close()


def _admin_dsn() -> str:
    return PG_DSN


@pytest.fixture(scope="session")
def django_project(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """Django set up on a fresh SQLite file (alias default), a fresh PostgreSQL database
    (alias pg) and a fresh MariaDB database (alias my), all migrated; dropped at the end."""
    require("PostgreSQL", *postgres_reachable())
    require("MariaDB", *mysql_reachable())
    folder = tmp_path_factory.mktemp("django")
    sqlite_path = str(folder / "project.sqlite3")
    with psycopg.connect(_admin_dsn(), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{PG_NAME}"')
    _mysql(f"CREATE DATABASE `{MYSQL_NAME}`")
    env = {"LEASE_TEST_DJANGO_SQLITE": sqlite_path,
           "LEASE_TEST_DJANGO_BARE": str(folder / "never-migrated.sqlite3"),
           "LEASE_TEST_DJANGO_PG": PG_NAME,
           "LEASE_TEST_DJANGO_MYSQL": MYSQL_NAME,
           "DJANGO_SETTINGS_MODULE": "tests.django_integration.project.settings",
           "LEASE_TEST_BROKER": REDIS_URL}
    os.environ.update(env)
    import django
    from django.core.management import call_command

    django.setup()
    for alias in ALIASES:
        call_command("migrate", database=alias, verbosity=0, interactive=False)
    try:
        yield env
    finally:
        from django.db import connections

        from lease_celery.stores.registry import shared_store

        for alias in ALIASES:
            shared_store(f"django://{alias}").close()
        connections.close_all()
        with psycopg.connect(_admin_dsn(), autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{PG_NAME}" WITH (FORCE)')
        _mysql(f"DROP DATABASE IF EXISTS `{MYSQL_NAME}`")
