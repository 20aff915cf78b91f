"""The admin's lists stay fast on a million leases, on PostgreSQL and on MariaDB: no page
counts a whole table, and every statement a page runs reads through an index (checked with
EXPLAIN)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import pytest

pytestmark = pytest.mark.usefixtures("django_project")

ROWS = 1_000_000

#: Per database alias: the statements that fill it, and those that remove the rows after.
#: One lease in a thousand running, about one in a thousand dead, the rest done; a history
#: entry for every other key.
FILL = {
    "pg": """
SET session_replication_role = replica;
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
SET session_replication_role = DEFAULT;
ANALYZE lease_celery_leases;
ANALYZE lease_celery_history
""",
    # MariaDB's sequence engine (seq_1_to_N) stands for generate_series. Its triggers stay on
    # (MariaDB cannot switch them off for a session): the running rows get their 'claimed'
    # entry, as a claim would have written it.
    "my": """
INSERT INTO lease_celery_leases (`key`, state, owner, token, expires_at, attempts, updated_at,
                                 reason, sweep_at)
SELECT CONCAT('bulk:', LPAD(seq, 7, '0')),
       CASE WHEN seq %% 1000 = 0 THEN 'running' WHEN seq %% 997 = 0 THEN 'dead' ELSE 'done' END,
       CONCAT('worker-', seq %% 50), 1 + seq %% 3, 1.8e9 + seq, 1, 1.7e9 + seq,
       CASE WHEN seq %% 997 = 0 THEN 'boom' END, NULL
FROM seq_1_to_{rows};
INSERT INTO lease_celery_history (`key`, at, event, token, detail)
SELECT CONCAT('bulk:', LPAD(seq DIV 2, 7, '0')), 1.7e9 + seq, 'claimed', 1, NULL
FROM seq_1_to_{rows};
ANALYZE TABLE lease_celery_leases;
ANALYZE TABLE lease_celery_history
""",
}
EMPTY = {
    "pg": """
DELETE FROM lease_celery_history WHERE key LIKE 'bulk:%%';
SET session_replication_role = replica;
DELETE FROM lease_celery_leases WHERE key LIKE 'bulk:%%';
SET session_replication_role = DEFAULT
""",
    # MariaDB: emptied whole (the alias's database is this test process's own, and no test of
    # another file runs in it meanwhile): a DELETE of the two million rows took 30 s.
    "my": """
TRUNCATE TABLE lease_celery_history;
TRUNCATE TABLE lease_celery_leases
""",
}


def _run(alias: str, script: str) -> None:
    from django.db import connections

    with connections[alias].cursor() as cursor:
        for statement in script.strip().format(rows=ROWS).split(";\n"):
            cursor.execute(statement, {"rows": ROWS})
            if statement.startswith("ANALYZE TABLE"):
                cursor.fetchall()  # MariaDB answers ANALYZE TABLE with a result set


@contextlib.contextmanager
def million(alias: str) -> Iterator[None]:
    """A million leases and history entries in the alias's tables, removed afterwards."""
    _run(alias, FILL[alias])
    try:
        yield
    finally:
        _run(alias, EMPTY[alias])


def full_scans(alias: str, queries: list[dict[str, Any]]) -> tuple[int, list[str]]:
    """How many statements of the lease tables were explained, and the plans among them
    that read a whole table."""
    from django.db import connections

    explained, scans = 0, []
    with connections[alias].cursor() as cursor:
        for query in queries:
            sql = query["sql"]
            if "lease_celery_" not in sql or not sql.lstrip().upper().startswith("SELECT"):
                continue
            cursor.execute("EXPLAIN " + sql.replace("%", "%%"))
            explained += 1
            if alias == "pg":
                plan = "\n".join(row[0] for row in cursor.fetchall())
                if "Seq Scan" in plan:
                    scans.append(f"{sql}\n{plan}")
                continue
            # MariaDB: a row per table read; type ALL is a scan of the whole table.
            columns = [column[0] for column in cursor.description]
            for row in cursor.fetchall():
                step = dict(zip(columns, row, strict=True))
                if step["type"] == "ALL" and str(step["table"]).startswith("lease_celery_"):
                    scans.append(f"{sql}\n{step}")
    return explained, scans


#: The pages an operator reads most: the lists, filtered, searched and paged, and a key's.
PAGES = (
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
)


# One test per database, every page in it: filling a million rows takes 20-40 s, and a test
# per page spread its fills over every pytest-xdist process (three fills per database).
@pytest.mark.parametrize("alias", ["pg", "my"], ids=["postgres", "mariadb"])
def test_every_page_on_a_million_rows_reads_through_indexes(alias: str) -> None:
    from django.contrib.auth.models import User

    admin = User.objects.filter(username="scale").first() or User.objects.create_superuser(
        "scale", password="pw")
    with million(alias):
        # The check can fail: a statement on a column no index holds is a scan.
        explained, scans = full_scans(alias, [
            {"sql": "SELECT owner FROM lease_celery_leases WHERE owner = 'worker-7'"}])
        assert (explained, bool(scans)) == (1, True)
        problems = [problem for page in PAGES for problem in page_problems(alias, admin, page)]
    assert not problems, "\n\n".join(problems)


def page_problems(alias: str, admin: Any, page: str) -> list[str]:
    """What is wrong with ``page`` on ``alias``'s million rows: an unbounded count, a scan of a
    whole table, or more than 2 s."""
    from django.db import connections
    from django.test import Client, override_settings
    from django.test.utils import CaptureQueriesContext

    client = Client()
    client.force_login(admin)
    with override_settings(LEASE_CELERY_STORE_URL=f"django://{alias}"), \
            CaptureQueriesContext(connections[alias]) as captured:
        started = time.perf_counter()
        response = client.get(page)
        took = time.perf_counter() - started
    if response.status_code != 200:
        return [f"{page}: status {response.status_code}"]
    problems = [f"{page}: a count with no LIMIT: {q['sql']}" for q in captured.captured_queries
                if "COUNT(" in q["sql"].upper() and "LIMIT" not in q["sql"].upper()]
    explained, scans = full_scans(alias, captured.captured_queries)
    if not explained:
        problems.append(f"{page}: read no lease table")
    problems += [f"{page}: {scan}" for scan in scans]
    if took >= 2.0:
        problems.append(f"{page}: took {took:.2f}s")
    return problems
