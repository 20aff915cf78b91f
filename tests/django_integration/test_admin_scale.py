"""The admin's lists stay fast on a million leases, on PostgreSQL and on MariaDB: no page
counts a whole table, and every statement a page runs reads through an index, and no more of
it than a page needs (checked with EXPLAIN ANALYZE)."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from typing import Any

import pytest

pytestmark = pytest.mark.usefixtures("django_project")

ROWS = 1_000_000
#: Receipts: fewer, since a receipts page's plan turns on how rare a state is, not on the
#: table's size, once the table is far larger than READ_BOUND (the fill costs ~1 s a database).
RECEIPTS = 200_000
#: The most rows a page's statement may read from a table: a page shows 50 rows and counts at
#: most up to the one after the next page. More is a walk along an index, which the check for
#: scans lets pass: before schema 8, the receipts list filtered by a rare state read 50,000
#: entries of the primary key for its 50 rows (PostgreSQL: an index scan and a filter).
READ_BOUND = 10_000

#: Per database alias: the statements that fill it, and those that remove the rows after.
#: One lease in a thousand running, about one in a thousand dead, the rest done; a history
#: entry for every other key; one receipt in a thousand needing reconciliation, about one in a
#: thousand in flight, the rest done.
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
INSERT INTO lease_celery_effects (key, fingerprint, state, lease_key, lease_token, lease_owner,
                                  started_at, attempts, version, updated_at)
SELECT 'bulk:' || lpad(i::text, 7, '0'), 'f',
       CASE WHEN i %% 1000 = 0 THEN 'needs_reconciliation' WHEN i %% 997 = 0 THEN 'in_flight'
            ELSE 'done' END,
       'bulk:' || lpad(i::text, 7, '0'), 1, 'worker-' || (i %% 50), 1.7e9 + i, 1, 1, 1.7e9 + i
FROM generate_series(1, %(receipts)s) AS i;
ANALYZE lease_celery_leases;
ANALYZE lease_celery_history;
ANALYZE lease_celery_effects
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
INSERT INTO lease_celery_effects (`key`, fingerprint, state, lease_key, lease_token, lease_owner,
                                  started_at, attempts, version, updated_at)
SELECT CONCAT('bulk:', LPAD(seq, 7, '0')), 'f',
       CASE WHEN seq %% 1000 = 0 THEN 'needs_reconciliation'
            WHEN seq %% 997 = 0 THEN 'in_flight' ELSE 'done' END,
       CONCAT('bulk:', LPAD(seq, 7, '0')), 1, CONCAT('worker-', seq %% 50), 1.7e9 + seq, 1, 1,
       1.7e9 + seq
FROM seq_1_to_{receipts};
ANALYZE TABLE lease_celery_leases;
ANALYZE TABLE lease_celery_history;
ANALYZE TABLE lease_celery_effects
""",
}
EMPTY = {
    "pg": """
DELETE FROM lease_celery_effects WHERE key LIKE 'bulk:%%';
DELETE FROM lease_celery_history WHERE key LIKE 'bulk:%%';
SET session_replication_role = replica;
DELETE FROM lease_celery_leases WHERE key LIKE 'bulk:%%';
SET session_replication_role = DEFAULT
""",
    # MariaDB: emptied whole (the alias's database is this test process's own, and no test of
    # another file runs in it meanwhile): a DELETE of the two million rows took 30 s.
    "my": """
TRUNCATE TABLE lease_celery_effects;
TRUNCATE TABLE lease_celery_history;
TRUNCATE TABLE lease_celery_leases
""",
}


def _run(alias: str, script: str) -> None:
    from django.db import connections

    with connections[alias].cursor() as cursor:
        for statement in script.strip().format(rows=ROWS, receipts=RECEIPTS).split(";\n"):
            cursor.execute(statement, {"rows": ROWS, "receipts": RECEIPTS})
            if statement.startswith("ANALYZE TABLE"):
                cursor.fetchall()  # MariaDB answers ANALYZE TABLE with a result set


@contextlib.contextmanager
def million(alias: str) -> Iterator[None]:
    """A million leases and history entries, and RECEIPTS receipts, in the alias's tables,
    removed afterwards."""
    _run(alias, FILL[alias])
    try:
        yield
    finally:
        _run(alias, EMPTY[alias])


def wide_reads(alias: str, queries: list[dict[str, Any]]) -> tuple[int, list[str]]:
    """How many statements of the lease tables were run again under EXPLAIN ANALYZE, and their
    reads of a table that read all of it or more than READ_BOUND of its rows."""
    from django.db import connections

    explained, wide = 0, []
    with connections[alias].cursor() as cursor:
        for query in queries:
            sql = query["sql"]
            if "lease_celery_" not in sql or not sql.lstrip().upper().startswith("SELECT"):
                continue
            explained += 1
            reads = (_pg_reads if alias == "pg" else _mariadb_reads)(cursor, sql)
            wide += [f"{sql}\n{read}" for read, rows, whole in reads
                     if whole or rows > READ_BOUND]
    return explained, wide


def _pg_reads(cursor: Any, sql: str) -> list[tuple[str, float, bool]]:
    """Each read of a lease table in the statement's plan, run: what it is, the rows it read
    (returned and filtered out), and whether it is a scan of the whole table."""
    cursor.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + sql.replace("%", "%%"))
    plan = cursor.fetchone()[0]
    plan = json.loads(plan) if isinstance(plan, str) else plan  # psycopg2 or psycopg 3
    reads, nodes = [], [plan[0]["Plan"]]
    while nodes:
        node = nodes.pop()
        nodes.extend(node.get("Plans", ()))
        if not str(node.get("Relation Name")).startswith("lease_celery_"):
            continue
        rows = node["Actual Loops"] * (node["Actual Rows"] + node.get("Rows Removed by Filter", 0)
                                       + node.get("Rows Removed by Index Recheck", 0))
        reads.append((f"{node['Node Type']} on {node['Relation Name']} "
                      f"({node.get('Index Name', 'no index')}): {rows:.0f} rows", rows,
                      node["Node Type"] == "Seq Scan"))
    return reads


def _mariadb_reads(cursor: Any, sql: str) -> list[tuple[str, float, bool]]:
    """Each read of a lease table (a row of MariaDB's ANALYZE: the statement run), the rows
    it read (r_rows), and whether it is a scan of the whole table (type ALL)."""
    cursor.execute("ANALYZE " + sql.replace("%", "%%"))
    columns = [column[0] for column in cursor.description]
    reads = []
    for row in cursor.fetchall():
        step = dict(zip(columns, row, strict=True))
        if str(step["table"]).startswith("lease_celery_"):
            reads.append((str(step), float(step["r_rows"] or 0), step["type"] == "ALL"))
    return reads


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
    "/admin/lease_celery/receipt/",
    "/admin/lease_celery/receipt/?state__exact=needs_reconciliation",
    "/admin/lease_celery/receipt/?state__exact=in_flight",
    "/admin/lease_celery/receipt/?q=bulk%3A00420",
    "/admin/lease_celery/receipt/bulk:0004200/change/",
)


# One test per database, every page in it: filling a million rows takes 20-40 s, and a test
# per page spread its fills over every pytest-xdist process (three fills per database).
@pytest.mark.parametrize("alias", ["pg", "my"], ids=["postgres", "mariadb"])
def test_every_page_on_a_million_rows_reads_through_indexes(alias: str) -> None:
    from django.contrib.auth.models import User

    admin = User.objects.filter(username="scale").first() or User.objects.create_superuser(
        "scale", password="pw")
    with million(alias):
        # The check can fail: a statement on a column no index holds is a scan, and one that
        # reads an index range longer than a page's is a walk.
        for sql in ("SELECT owner FROM lease_celery_leases WHERE owner = 'worker-7'",
                    f"SELECT id FROM lease_celery_history ORDER BY id LIMIT {2 * READ_BOUND}"):
            explained, wide = wide_reads(alias, [{"sql": sql}])
            assert (explained, len(wide)) == (1, 1), (sql, wide)
        problems = [problem for page in PAGES for problem in page_problems(alias, admin, page)]
    assert not problems, "\n\n".join(problems)


def page_problems(alias: str, admin: Any, page: str) -> list[str]:
    """What is wrong with ``page`` on ``alias``'s million rows: an unbounded count, a read of a
    whole table or of more than READ_BOUND rows, or more than 2 s."""
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
    explained, wide = wide_reads(alias, captured.captured_queries)
    if not explained:
        problems.append(f"{page}: read no lease table")
    problems += [f"{page}: {read}" for read in wide]
    if took >= 2.0:
        problems.append(f"{page}: took {took:.2f}s")
    return problems
