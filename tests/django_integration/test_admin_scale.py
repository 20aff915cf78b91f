"""The admin's lists stay fast on a million leases (PostgreSQL): no page counts a whole
table, and every statement a page runs reads through an index (checked with EXPLAIN)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

pytestmark = pytest.mark.usefixtures("django_project")

ROWS = 1_000_000

FILL = """
INSERT INTO lease_celery_leases (key, state, owner, token, expires_at, attempts, updated_at,
                                 reason, sweep_at)
SELECT 'bulk:' || lpad(i::text, 7, '0'),
       CASE WHEN i %% 1000 = 0 THEN 'running' WHEN i %% 997 = 0 THEN 'dead' ELSE 'done' END,
       'worker-' || (i %% 50), 1 + i %% 3, 1.8e9 + i, 1, 1.7e9 + i,
       CASE WHEN i %% 997 = 0 THEN 'boom' END, NULL
FROM generate_series(1, %(rows)s) AS i;
INSERT INTO lease_celery_history (key, at, event, token, detail)
SELECT 'bulk:' || lpad((i / 2)::text, 7, '0'), 1.7e9 + i, 'claimed', 1, NULL
FROM generate_series(1, %(rows)s) AS i;
"""


@pytest.fixture(scope="module")
def million() -> Iterator[None]:
    """A million leases and history entries in the pg alias's tables (triggers off while
    filling: the rows are not transitions), removed afterwards."""
    from django.db import connections

    with connections["pg"].cursor() as cursor:
        cursor.execute("SET session_replication_role = replica")
        for statement in FILL.strip().split(";\n"):
            cursor.execute(statement, {"rows": ROWS})
        cursor.execute("SET session_replication_role = DEFAULT")
        cursor.execute("ANALYZE lease_celery_leases")
        cursor.execute("ANALYZE lease_celery_history")
    yield
    with connections["pg"].cursor() as cursor:
        cursor.execute("DELETE FROM lease_celery_history WHERE key LIKE 'bulk:%%'")
        cursor.execute("SET session_replication_role = replica")
        cursor.execute("DELETE FROM lease_celery_leases WHERE key LIKE 'bulk:%%'")
        cursor.execute("SET session_replication_role = DEFAULT")


def plans(queries: list[dict[str, Any]]) -> list[tuple[str, str]]:
    from django.db import connections

    found = []
    with connections["pg"].cursor() as cursor:
        for query in queries:
            sql = query["sql"]
            if "lease_celery_" not in sql or not sql.lstrip().upper().startswith("SELECT"):
                continue
            cursor.execute("EXPLAIN " + sql.replace("%", "%%"))
            found.append((sql, "\n".join(row[0] for row in cursor.fetchall())))
    return found


@pytest.mark.parametrize("page", [
    "/admin/lease_celery/lease/",
    "/admin/lease_celery/lease/?p=3",
    "/admin/lease_celery/lease/?state__exact=running",
    "/admin/lease_celery/lease/?state__exact=dead",
    "/admin/lease_celery/lease/?state__exact=ready",
    "/admin/lease_celery/lease/?q=bulk%3A00420",
    "/admin/lease_celery/lease/bulk:0004200/change/",
    "/admin/lease_celery/historyentry/",
    "/admin/lease_celery/historyentry/?key=bulk%3A0004200",
    "/admin/lease_celery/historyentry/?q=bulk%3A0004200",
])
def test_a_page_on_a_million_rows_reads_through_indexes(million: None, page: str) -> None:
    from django.contrib.auth.models import User
    from django.db import connections
    from django.test import Client, override_settings
    from django.test.utils import CaptureQueriesContext

    admin = User.objects.filter(username="scale").first() or User.objects.create_superuser(
        "scale", password="pw")
    client = Client()
    client.force_login(admin)
    with override_settings(LEASE_CELERY_STORE_URL="django://pg"), \
            CaptureQueriesContext(connections["pg"]) as captured:
        started = time.perf_counter()
        response = client.get(page)
        took = time.perf_counter() - started
    assert response.status_code == 200
    counts = [q["sql"] for q in captured.captured_queries if "COUNT(" in q["sql"].upper()]
    assert all("LIMIT" in sql.upper() for sql in counts), counts  # bounded counts only
    explained = plans(captured.captured_queries)
    assert explained  # the page read the lease tables
    for sql, plan in explained:
        assert "Seq Scan" not in plan, f"{sql}\n{plan}"
    assert took < 2.0, f"{page} took {took:.2f}s"
