"""The migrations and the store make the same schema: one definition, checked here.

The store's schema version (``sql_glue.SCHEMA_VERSION``) and what its SQL files create are
compared with what ``manage.py migrate`` made: every table, column, index, trigger, function
and sequence of the lease tables, on PostgreSQL, MariaDB and SQLite.
"""

from __future__ import annotations

import importlib
import sqlite3
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest

from lease_celery import open_store
from lease_celery.errors import StoreError
from lease_celery.stores.sql_glue import SCHEMA_VERSION
from tests.support.servers import PG_DSN

MIGRATIONS = Path(__file__).resolve().parents[2] / "lease_celery/contrib/django/migrations"


def pg_catalog(dsn: str) -> dict[str, Any]:
    """The lease tables' catalog in a PostgreSQL database (schema public)."""
    queries = {
        "columns": """SELECT table_name, column_name, data_type, is_nullable, column_default
                      FROM information_schema.columns
                      WHERE table_schema = 'public' AND table_name LIKE 'lease_celery_%'
                      ORDER BY 1, 2""",
        "indexes": """SELECT indexname, indexdef FROM pg_indexes
                      WHERE schemaname = 'public' AND tablename LIKE 'lease_celery_%'
                      ORDER BY 1""",
        "triggers": """SELECT tgname, pg_get_triggerdef(t.oid) FROM pg_trigger t
                       JOIN pg_class c ON c.oid = t.tgrelid
                       WHERE NOT tgisinternal AND c.relname LIKE 'lease_celery_%' ORDER BY 1""",
        "functions": """SELECT proname, prosrc FROM pg_proc p
                        JOIN pg_namespace n ON n.oid = p.pronamespace
                        WHERE n.nspname = 'public' AND proname LIKE 'lease_celery_%'
                        ORDER BY 1""",
        "sequences": """SELECT sequence_name FROM information_schema.sequences
                        WHERE sequence_schema = 'public' ORDER BY 1""",
        "constraints": """SELECT conname, pg_get_constraintdef(c.oid) FROM pg_constraint c
                          JOIN pg_class t ON t.oid = c.conrelid
                          WHERE t.relname LIKE 'lease_celery_%' ORDER BY 1""",
        "meta": "SELECT name, value FROM lease_celery_meta ORDER BY 1",
    }
    with psycopg.connect(dsn) as conn:
        return {name: conn.execute(query).fetchall() for name, query in queries.items()}


def sqlite_catalog(path: str) -> dict[str, Any]:
    with sqlite3.connect(path) as conn:
        return {
            "objects": conn.execute("SELECT type, name, tbl_name, sql FROM sqlite_master "
                                    "WHERE name LIKE 'lease_celery_%' ORDER BY 2").fetchall(),
            "meta": conn.execute("SELECT name, value FROM lease_celery_meta").fetchall(),
        }


def mysql_catalog(database: str) -> dict[str, Any]:
    """The lease tables' catalog in a MariaDB database."""
    from tests.support.mysql_databases import server_connection

    queries = {
        "tables": """SELECT table_name, table_type, engine, table_collation
                     FROM information_schema.tables WHERE table_schema = %s ORDER BY 1""",
        "columns": """SELECT table_name, column_name, column_type, is_nullable, column_default,
                             collation_name, extra
                      FROM information_schema.columns WHERE table_schema = %s
                      AND table_name LIKE 'lease_celery_%%' ORDER BY 1, 2""",
        "indexes": """SELECT table_name, index_name, seq_in_index, column_name, sub_part,
                             non_unique, index_type
                      FROM information_schema.statistics WHERE table_schema = %s
                      AND table_name LIKE 'lease_celery_%%' ORDER BY 1, 2, 3""",
        "triggers": """SELECT trigger_name, event_manipulation, event_object_table,
                              action_timing, action_statement
                       FROM information_schema.triggers WHERE trigger_schema = %s
                       ORDER BY 1""",
    }
    conn = server_connection()
    try:
        with conn.cursor() as cursor:
            found = {}
            for name, query in queries.items():
                cursor.execute(query, (database,))
                found[name] = [
                    tuple(v for v in row if v != database) for row in cursor.fetchall()]
            cursor.execute(f"SELECT name, value FROM `{database}`.lease_celery_meta")
            found["meta"] = list(cursor.fetchall())
        return found
    finally:
        conn.close()


def test_the_latest_migration_leaves_the_stores_schema_version() -> None:
    """A new store schema needs a new migration (that runs the store's DDL again)."""
    latest = sorted(p.stem for p in MIGRATIONS.glob("0*.py"))[-1]
    module = importlib.import_module(f"lease_celery.contrib.django.migrations.{latest}")
    assert module.STORE_SCHEMA_VERSION == SCHEMA_VERSION, (
        f"sql_glue.SCHEMA_VERSION is {SCHEMA_VERSION} but the latest migration ({latest}) "
        f"leaves {module.STORE_SCHEMA_VERSION}: add a migration running create_store_schema")


def test_migrate_makes_on_postgresql_what_the_store_makes(
        django_project: dict[str, str]) -> None:
    """manage.py migrate on PostgreSQL and a PostgresStore on an empty database: the same
    tables, columns, indexes, triggers, functions, sequences and schema version."""
    base = PG_DSN.rsplit("/", 1)[0]
    fresh = f"lease_store_only_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(PG_DSN, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{fresh}"')
    try:
        store = open_store(f"{base}/{fresh}")
        store.get("any")  # the store makes its schema at its first statement
        store.close()
        migrated = pg_catalog(f"{base}/{django_project['LEASE_TEST_DJANGO_PG']}")
        made = pg_catalog(f"{base}/{fresh}")
    finally:
        with psycopg.connect(PG_DSN, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{fresh}" WITH (FORCE)')
    assert migrated["meta"] == [("schema_version", str(SCHEMA_VERSION))]
    assert migrated["columns"] and migrated["indexes"] and migrated["triggers"]
    assert migrated == made


def test_migrate_makes_on_sqlite_what_the_store_makes(django_project: dict[str, str],
                                                      tmp_path: Path) -> None:
    path = tmp_path / "store-only.sqlite3"
    store = open_store(f"sqlite:///{path}")
    store.get("any")
    store.close()
    migrated = sqlite_catalog(django_project["LEASE_TEST_DJANGO_SQLITE"])
    assert migrated["meta"] == [("schema_version", str(SCHEMA_VERSION))]
    assert len(migrated["objects"]) > 10
    assert migrated == sqlite_catalog(str(path))


def test_migrate_makes_on_mariadb_what_the_store_makes(django_project: dict[str, str]) -> None:
    """manage.py migrate through Django's MySQL backend (mysqlclient) and a MySQLStore on an
    empty database: the same tables, columns, indexes, triggers, sequence and version."""
    from tests.support.mysql_databases import database

    migrated = mysql_catalog(django_project["LEASE_TEST_DJANGO_MYSQL"])
    with database() as url:
        store = open_store(url)
        store.get("any")  # the store makes its schema at its first statement
        store.close()
        made = mysql_catalog(url.rsplit("/", 1)[1])
    assert migrated["meta"] == [("schema_version", str(SCHEMA_VERSION))]
    assert migrated["columns"] and migrated["indexes"] and migrated["triggers"]
    # The project's own tables (auth, shop) are in the migrated database only.
    migrated["tables"] = [row for row in migrated["tables"] if row[0].startswith("lease_")]
    assert migrated == made


def test_a_database_not_migrated_is_refused_with_what_to_run(
        django_project: dict[str, str]) -> None:
    store = open_store("django://bare")
    with pytest.raises(StoreError, match=r"manage\.py migrate lease_celery --database bare"):
        store.get("any")
    store.close()


def test_migrating_again_changes_nothing(django_project: dict[str, str]) -> None:
    """The migration's step on a database that has the schema (made by a store earlier, or
    migrated already): no change, no error."""
    from django.db import connections

    from lease_celery.contrib.django.schema import create_store_schema

    before = pg_catalog(f"{PG_DSN.rsplit('/', 1)[0]}/{django_project['LEASE_TEST_DJANGO_PG']}")
    with connections["pg"].schema_editor() as editor:
        create_store_schema(editor)
    after = pg_catalog(f"{PG_DSN.rsplit('/', 1)[0]}/{django_project['LEASE_TEST_DJANGO_PG']}")
    assert before == after
    before = mysql_catalog(django_project["LEASE_TEST_DJANGO_MYSQL"])
    with connections["my"].schema_editor() as editor:
        create_store_schema(editor)
    assert mysql_catalog(django_project["LEASE_TEST_DJANGO_MYSQL"]) == before


def test_the_models_and_the_migrations_agree(django_project: dict[str, str]) -> None:
    """makemigrations finds nothing to add for the app: its models (the admin's views of the
    tables) are the migration's."""
    from django.core.management import call_command

    call_command("makemigrations", "lease_celery", check=True, dry_run=True, verbosity=0)


def test_a_connection_lost_while_a_process_opens_the_store_is_a_store_error(
        django_project: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """The first statement of a process opens its django:// store on PostgreSQL and checks the
    schema version; a connection killed right then (pg_terminate_backend, a restart) is the
    store's ``StoreError``, which the task's gate defers as a store outage, never the driver's
    error (found by the django-tx chaos run: a fresh pool child's claim failed with
    ``AdminShutdown``, its task stored a FAILURE and its key was left without a row)."""
    from lease_celery.contrib.django.postgres import DjangoPostgresStore

    def killed(self: DjangoPostgresStore) -> Any:
        raise psycopg.errors.AdminShutdown("terminating connection due to administrator command")

    monkeypatch.setattr(DjangoPostgresStore, "_connect", killed)
    store = open_store("django://pg")
    with pytest.raises(StoreError, match=r"Django database 'pg'.*administrator command"):
        store.claim(f"opening-{uuid.uuid4().hex[:6]}", owner="me", ttl=30)
    monkeypatch.undo()
    assert store.get("any") is None  # the next statement opens it
    store.close()
