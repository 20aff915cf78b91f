"""The app's own database and the lease in one transaction, with real workers.

A body whose rows commit before its finish (``self.lease.fenced()``, then the finish after the
return) leaves a window: a worker that dies between the two leaves the rows committed on a
key that is not done, and the next owner runs the body again, under a new token, its writes
accepted. ``self.lease.transaction(conn)`` closes it: the rows and the finish commit together,
so the redelivery is answered from the row and the body never runs again.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest

import lease_celery
from lease_celery import open_store
from lease_celery.app_connections import app_connection
from tests.support import app_db
from tests.support.publisher import publisher
from tests.support.servers import REDIS_URL
from tests.support.workers import WorkerPool

APP_WRITE = "tests.support.worker_app.app_write"


@pytest.mark.parametrize("worker_store", ["sqlite", "postgres", "mysql"], indirect=True)
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
    with open_store(workers.store_url) as store:
        assert app_db.rows(store, job) == list(range(1, runs + 1))


@pytest.mark.parametrize("worker_store", ["sqlite", "postgres"], indirect=True)
@pytest.mark.worker_env(LEASE_TEST_TTL="1.5", LEASE_TEST_HEARTBEAT="0.4")
def test_a_commit_whose_reply_was_lost_is_known_by_its_row(workers: WorkerPool) -> None:
    """The commit reached the server and the connection dropped before its reply (the driver
    raises OperationalError): the key is done under this lease, so the task's outcome is the
    committed one (SUCCESS, once), not the driver's error; the body never runs again."""
    workers.start("a", concurrency=1)
    job = uuid.uuid4().hex[:12]
    result = workers.client.send_task(APP_WRITE, args=(job, "commit_reply_lost", False))
    assert result.get(timeout=60) == {"job_id": job, "token": 1}
    assert len(workers.journal.events("body_start", job_id=job)) == 1
    with open_store(workers.store_url) as store:
        assert app_db.rows(store, job) == [1]


# -- enqueue in the caller's transaction: the row is the outbox --------------------------------

GRACE, INTERVAL = 2.0, 0.5
OUTBOX_ENV = {"LEASE_TEST_TTL": "2", "LEASE_TEST_HEARTBEAT": "0.5",
              "LEASE_TEST_SWEEP_INTERVAL": str(INTERVAL), "LEASE_TEST_SWEEP_GRACE": str(GRACE)}


class _Boom(Exception):
    pass


@pytest.mark.parametrize("worker_store", ["sqlite", "postgres"], indirect=True)
@pytest.mark.parametrize("kind", app_db.KINDS)
@pytest.mark.worker_env(**OUTBOX_ENV)
def test_a_task_enqueued_in_a_transaction_runs_only_if_it_commits(
        workers: WorkerPool, kind: str) -> None:
    """Two orders, each with its task enqueued in the transaction that writes it: the
    committed one runs once (published as the transaction commits); the rolled-back one
    leaves no row and no message, and never runs, not even after the sweeper's grace."""
    workers.start("a", concurrency=2)
    task = publisher(REDIS_URL, workers.env["LEASE_TEST_QUEUE"], workers.store_url)
    kept, dropped = _job(), _job()
    with open_store(workers.store_url) as store:
        conn = app_db.connect(store, kind)
        try:
            committed = _enqueue(conn, store, task, kept, commit=True)
            _enqueue(conn, store, task, dropped, commit=False)
        finally:
            app_db.close(conn)
        assert store.get(f"job:{dropped}") is None
        assert app_db.rows(store, dropped) == []
    assert committed.get(timeout=30)["job_id"] == kept
    time.sleep(GRACE + 3 * INTERVAL)
    assert [s["task_id"] for s in workers.journal.events("body_start", job_id=kept)] == [
        committed.id]
    assert workers.journal.events("task_received", job_id=dropped) == []
    assert workers.journal.events("body_start", job_id=dropped) == []


def _enqueue(conn: Any, store: Any, task: Any, job: str, *, commit: bool) -> Any:
    """Write the order's row and enqueue its task in one transaction of ``conn``'s, then
    commit (the message goes out) or roll back."""
    if hasattr(conn, "get_bind"):  # a Session publishes on its own commit
        with conn.begin():
            app_db.insert(conn, store, job)
            result = task.apply_async((job, 0.1), lease_transaction=conn)
            if not commit:
                conn.rollback()
        return result
    try:
        with lease_celery.transaction(conn):
            app_db.insert(conn, store, job)
            result = task.apply_async((job, 0.1), lease_transaction=conn)
            if not commit:
                raise _Boom()
    except _Boom:
        pass
    return result


@pytest.mark.parametrize("worker_store", ["sqlite", "postgres"], indirect=True)
@pytest.mark.worker_env(**OUTBOX_ENV)
def test_a_commit_whose_publish_never_happened_is_published_from_its_row(
        workers: WorkerPool) -> None:
    """The publisher commits and never publishes (it died right after the commit, or the
    broker was down): the row is the outbox, and the sweeper publishes the task from it a
    grace period later; it runs once, under the task id the publisher was given."""
    workers.start("a", concurrency=2)
    task = publisher(REDIS_URL, workers.env["LEASE_TEST_QUEUE"], workers.store_url)
    job = _job()
    with open_store(workers.store_url) as store:
        conn = app_db.connect(store, "driver")
        try:
            app_connection(conn).begin()
            app_db.insert(conn, store, job)
            result = task.apply_async((job, 0.1), lease_transaction=conn)
            conn.commit()  # and no publish_committed: as if the process died here
            committed_at = time.time()
        finally:
            app_db.close(conn)
        assert store.get(f"job:{job}").task_id == result.id
    assert result.get(timeout=30)["job_id"] == job
    starts = workers.journal.events("body_start", job_id=job)
    assert [s["task_id"] for s in starts] == [result.id]
    assert starts[0]["t"] - committed_at > GRACE - 0.5
    assert [e["key"] for e in workers.journal.events("lease_swept")] == [f"job:{job}"]


def _job() -> str:
    return uuid.uuid4().hex[:12]
