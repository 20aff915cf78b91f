"""Outcomes that must not be lost or reported twice when a lease lapses or a worker dies at
an unlucky moment (real workers, Redis broker, SQLite store)."""

from __future__ import annotations

import time
import uuid

import pytest

from lease_celery import LeaseState, open_store
from tests.support.workers import WorkerPool

pytestmark = pytest.mark.worker

UNCHECKED = "tests.support.worker_app.unchecked"
CALLBACK = "tests.support.worker_app.callback"


@pytest.mark.worker_env(LEASE_TEST_TTL="2", LEASE_TEST_HEARTBEAT="0.5")
def test_operator_release_during_the_body_reruns_the_task_instead_of_losing_it(
        workers: WorkerPool) -> None:
    """An operator releases a running lease (``celery leases release``): the running body's
    finish is refused, and since nobody else took the key, its delivery is re-published and
    runs again under token 2: one SUCCESS, no FAILURE, nothing lost."""
    workers.start("a", concurrency=2)
    job, task_id = uuid.uuid4().hex[:10], str(uuid.uuid4())
    result = workers.client.send_task(UNCHECKED, args=(job, 1.0), task_id=task_id)
    workers.journal.wait_for(lambda j: bool(j.events("body_start", job_id=job)), timeout=20,
                             what="the body to start")
    with open_store(workers.store_url) as store:
        assert store.force_release(f"job:{job}", reason="operator") is True
    assert result.get(timeout=30)["token"] == 2
    assert [e["token"] for e in workers.journal.events("body_start", job_id=job)] == [1, 2]
    assert workers.journal.events("stale_result_rejected", key=f"job:{job}", token=1)
    with open_store(workers.store_url) as store:
        record = store.get(f"job:{job}")
    assert record is not None and (record.state, record.token) == (LeaseState.DONE, 2)


@pytest.mark.worker_env(LEASE_TEST_TTL="2", LEASE_TEST_HEARTBEAT="0.5")
def test_redelivery_completes_a_run_whose_result_never_reached_the_backend(
        workers: WorkerPool) -> None:
    """The accepted run finished its lease (done, result recorded, settling) but its worker
    died before Celery wrote the result and sent the callbacks, so it never confirmed. The
    redelivery of that task id waits for the settle deadline, then, without running the body,
    completes the task with the accepted result, and the link callback runs once. A further
    redelivery finds the key settled and is dropped."""
    workers.start("a", concurrency=1)
    job, task_id = uuid.uuid4().hex[:10], str(uuid.uuid4())
    key = f"job:{job}"
    accepted = {"job_id": job, "token": 1, "pid": 0}
    info = {"task": UNCHECKED, "args": [job, 0.0], "kwargs": {},
            "options": {"task_id": task_id}}
    with open_store(workers.store_url) as store:  # the dead worker's accepted run
        lease = store.claim(key, owner="dead-worker", ttl=30, task=info)
        assert lease is not None and store.finish(lease, accepted, settle_within=1)
    link = workers.client.signature(CALLBACK, args=(job,))
    result = workers.client.send_task(UNCHECKED, args=(job, 0.0), task_id=task_id, link=link)
    assert result.get(timeout=30) == accepted
    workers.journal.wait_for(lambda j: bool(j.events("callback", tag=job)), timeout=15,
                             what="the callback")
    workers.client.send_task(UNCHECKED, args=(job, 0.0), task_id=task_id, link=link)
    workers.journal.wait_for(lambda j: bool(j.events("duplicate_ignored", key=key)),
                             timeout=15, what="the second redelivery to be dropped")
    with open_store(workers.store_url) as store:
        record = store.get(key)
    assert record is not None and not record.settling and record.result == accepted
    time.sleep(0.5)
    assert not workers.journal.events("body_start", job_id=job)
    assert len(workers.journal.events("callback", tag=job)) == 1
