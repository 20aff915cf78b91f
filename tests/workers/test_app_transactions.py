"""The app's own database and the lease in one transaction, with real workers.

A body whose rows commit before its finish (``self.lease.fenced()``, then the finish after the
return) leaves a window: a worker that dies between the two leaves the rows committed on a
key that is not done, and the next owner runs the body again, under a new token, its writes
accepted. ``self.lease.transaction(conn)`` closes it: the rows and the finish commit together,
so the redelivery is answered from the row and the body never runs again.
"""

from __future__ import annotations

import uuid

import pytest

from lease_celery import open_store
from tests.support.worker_app import app_database
from tests.support.workers import WorkerPool

APP_WRITE = "tests.support.worker_app.app_write"


def _app_rows(store_url: str, job: str) -> list[int]:
    with open_store(store_url) as store:
        conn, table, mark = app_database(store)
        try:
            rows = conn.execute(f"SELECT token FROM {table} WHERE job_id = {mark} "
                                "ORDER BY token", (job,)).fetchall()
        finally:
            conn.close()
    return [token for (token,) in rows]


@pytest.mark.parametrize("worker_store", ["sqlite", "postgres"], indirect=True)
@pytest.mark.parametrize(("mode", "runs"), [("fenced", 2), ("transaction", 1)])
@pytest.mark.worker_env(LEASE_TEST_TTL="1.5", LEASE_TEST_HEARTBEAT="0.4")
def test_a_worker_dying_between_the_app_commit_and_the_return(
        workers: WorkerPool, mode: str, runs: int) -> None:
    """The pool process dies right after the app's row committed. ``fenced``: the finish was
    never written, so the redelivery runs the body again and the effect happens twice (the
    seam this feature closes, kept here as fenced()'s documented limit). ``transaction``: the
    finish committed with the row; the redelivery is answered with the first run's outcome."""
    workers.start("a", concurrency=1)
    job = uuid.uuid4().hex[:12]
    result = workers.client.send_task(APP_WRITE, args=(job, mode))
    outcome = result.get(timeout=60)
    assert len(workers.journal.events("body_start", job_id=job)) == runs
    assert outcome == {"job_id": job, "token": runs}
    assert _app_rows(workers.store_url, job) == list(range(1, runs + 1))
