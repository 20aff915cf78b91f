"""The store's statements on Django's own connection (``DjangoConnection``), inside
``transaction.atomic()``, in this process: what ``self.lease.atomic()`` and
``delay_on_commit`` write, on every database and driver Django runs the project on
(SQLite; PostgreSQL on psycopg 3; MariaDB on mysqlclient, whose parameters are the
``%(name)s`` the MySQL store's statements are written in). The workers' tests run the
same through real workers.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from lease_celery.contrib.django.transactions import DjangoConnection
from lease_celery.errors import LeaseLost
from lease_celery.stores.base import Store
from lease_celery.stores.registry import shared_store
from tests.support.workers import REPO

pytestmark = pytest.mark.usefixtures("django_project")


class Rollback(Exception):
    """Raised inside an atomic block to roll it back."""


@pytest.fixture(params=["default", "pg", "my"], ids=["sqlite", "postgres", "mariadb"])
def alias(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def store(alias: str) -> Store:
    return shared_store(f"django://{alias}")


def test_the_finish_commits_with_the_models_rows_or_not_at_all(alias: str,
                                                                  store: Store) -> None:
    from django.db import transaction

    from tests.django_integration.project.shop.models import Order

    tag = uuid.uuid4().hex[:8]
    lease = store.claim(f"tx:{tag}:a", owner="w", ttl=30)
    assert lease is not None
    with pytest.raises(Rollback), transaction.atomic(using=alias):
        conn = DjangoConnection(alias)
        store.lock_in(conn, lease, when="before")
        Order.objects.using(alias).create(number=f"{tag}-rb", amount=1)
        assert store.finish_in(conn, lease, {"rolled": "back"})
        raise Rollback
    assert not Order.objects.using(alias).filter(number=f"{tag}-rb").exists()
    record = store.get(lease.key)
    assert record is not None and record.state.value == "running"

    with transaction.atomic(using=alias):
        conn = DjangoConnection(alias)
        store.lock_in(conn, lease, when="before")
        Order.objects.using(alias).create(number=f"{tag}-ok", amount=1)
        assert store.finish_in(conn, lease, {"paid": tag})
    assert Order.objects.using(alias).filter(number=f"{tag}-ok").exists()
    record = store.get(lease.key)
    assert record is not None and record.state.value == "done"
    assert record.result == {"paid": tag}


def test_a_lease_taken_over_is_refused_inside_the_block(alias: str, store: Store) -> None:
    from django.db import transaction

    key = f"tx:{uuid.uuid4().hex[:8]}:b"
    stale = store.claim(key, owner="old", ttl=30)
    assert stale is not None
    store.force_release(key, reason="test")
    assert store.claim(key, owner="new", ttl=30) is not None
    with pytest.raises(LeaseLost), transaction.atomic(using=alias):
        store.lock_in(DjangoConnection(alias), stale, when="before the writes")
    with transaction.atomic(using=alias):
        assert not store.finish_in(DjangoConnection(alias), stale, "late")


def test_the_outbox_row_exists_only_if_the_transaction_commits(alias: str,
                                                                store: Store) -> None:
    from django.db import transaction

    tag = uuid.uuid4().hex[:8]
    task = {"name": "note", "id": tag}
    with pytest.raises(Rollback), transaction.atomic(using=alias):
        assert store.record_published_in(DjangoConnection(alias), f"tx:{tag}:rb", task=task)
        raise Rollback
    assert store.get(f"tx:{tag}:rb") is None
    with transaction.atomic(using=alias):
        assert store.record_published_in(DjangoConnection(alias), f"tx:{tag}:ok", task=task)
        # Published already (the same key again, in the same transaction): not a new row.
        assert not store.record_published_in(DjangoConnection(alias), f"tx:{tag}:ok",
                                             task=task)
    record = store.get(f"tx:{tag}:ok")
    assert record is not None and record.state.value == "ready"


def test_each_alias_runs_on_the_driver_a_project_of_its_kind_runs() -> None:
    """The drivers these tests mean to cover: mysqlclient for MariaDB (Django's default),
    psycopg 3 for PostgreSQL (psycopg2 in the run of test_a_psycopg2_project)."""
    from django.db import connections

    expected = "psycopg2" if os.environ.get("LEASE_TEST_DJANGO_PSYCOPG2") else "psycopg"
    connections["pg"].ensure_connection()
    connections["my"].ensure_connection()
    assert type(connections["pg"].connection).__module__.split(".")[0] == expected
    assert type(connections["my"].connection).__module__.split(".")[0] == "MySQLdb"


@pytest.mark.skipif(bool(os.environ.get("LEASE_TEST_DJANGO_PSYCOPG2")), reason="that run")
def test_a_psycopg2_project(tmp_path: Path) -> None:
    """A project whose PostgreSQL backend runs on psycopg2 (psycopg 3 installed beside it for
    the store's own connections): migrations, the store, and the statements of
    ``self.lease.atomic()`` and ``delay_on_commit`` on Django's psycopg2 cursor, an admin
    action. Django picks its driver once per process: these run in a pytest of their own."""
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
         __file__, str(Path(__file__).with_name("test_admin.py")),
         "-k", "postgres or driver or (release and pg)",
         "--basetemp", str(tmp_path / "run")],
        env={**os.environ, "LEASE_TEST_DJANGO_PSYCOPG2": "1"}, cwd=REPO,
        capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "\n5 passed" in done.stdout, done.stdout[-2000:]
