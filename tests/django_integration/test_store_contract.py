"""The store contract's own tests (tests/stores), run on ``django://`` stores: the SQL
stores' logic through connections Django's backend makes, on SQLite, PostgreSQL and MariaDB.

Each test gets the alias's lease tables emptied first (the contract's tests expect a store
of their own); the migrations made the tables, the store only checks them.
"""

from __future__ import annotations

import pytest

from tests.stores.test_effects import *  # noqa: F403
from tests.stores.test_store_fencing import *  # noqa: F403
from tests.stores.test_store_operations import *  # noqa: F403

TABLES = ("lease_celery_leases", "lease_celery_effects", "lease_celery_history",
          "lease_celery_limits", "lease_celery_waiters")


@pytest.fixture(params=["default", "pg", "my"],
                ids=["django-sqlite", "django-postgres", "django-mariadb"])
def store_url(request: pytest.FixtureRequest, django_project: dict[str, str]) -> str:
    from django.db import connections

    with connections[request.param].cursor() as cursor:
        for table in TABLES:
            cursor.execute(f"DELETE FROM {table}")
    return f"django://{request.param}"
