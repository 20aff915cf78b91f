"""Outcomes that must not be lost or reported twice when a lease lapses or a worker dies at
an unlucky moment (real workers, Redis broker, SQLite store)."""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest
import redis

from lease_celery import LeaseState, open_store
from lease_celery.execution.delivery import republish
from lease_celery.execution.recovery import FIRST_PRIORITY_HEADER
from tests.support.backlog import BACKLOG, stalled_owner_behind_a_backlog
from tests.support.queues import published
from tests.support.servers import REDIS_URL
from tests.support.tokens import token_base
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


@pytest.mark.worker_env(LEASE_TEST_TTL="2", LEASE_TEST_HEARTBEAT="0.5",
                        LEASE_TEST_SWEEP_INTERVAL="0.5", LEASE_TEST_DEFAULT_PRIORITY="5")
def test_a_stalled_owners_key_runs_again_ahead_of_the_backlog_on_redis(
        workers: WorkerPool) -> None:
    """A pool process is SIGSTOPped holding a lease, and 40 tasks of 0.25 s are queued behind
    it at priority 5 (``task_default_priority``). The sweeper re-publishes the expired key at
    priority 0, the list kombu's Redis transport pops first: it runs again (token 2) before
    most of the backlog. Before recovery had a priority it waited behind all 40."""
    recovery = stalled_owner_behind_a_backlog(workers)
    print(recovery)  # the figures (pytest -s)
    assert recovery.token == token_base(workers.store_url) + 2
    assert recovery.started_before < BACKLOG // 2, recovery


def _published(client: redis.Redis, queue: str) -> list[tuple[str, int | None, Any]]:
    """(list, priority, lease_priority header) of every message in ``queue``, which is then
    emptied for the next step."""
    found = [(m["list"], m["priority"], m["headers"].get(FIRST_PRIORITY_HEADER, "absent"))
             for m in published(queue)]
    for key in client.scan_iter(match=f"{queue}*"):
        client.delete(key)
    return found


def test_recovered_work_goes_first_and_a_copy_of_it_deferred_goes_back_to_its_list() -> None:
    """On a real Redis broker: recovered work (``republish(..., recovery=True)``) goes to the
    first priority list, noting the priority it was published with; a re-publish of that copy
    that is not recovery (a deferred duplicate, an operator's requeue) goes back to the list of
    its first priority, and to the task's default when it had none; recovering the copy again
    keeps the first priority noted. ``lease_recovery_priority=False`` leaves priorities alone,
    and an explicit number is used as it is."""
    from celery import Celery

    queue = f"lease-tests-priority-{uuid.uuid4().hex[:8]}"
    app = Celery("priorities", broker=REDIS_URL, set_as_current=False)
    app.conf.task_default_queue = queue
    client = redis.Redis.from_url(REDIS_URL)

    def info(**options: Any) -> dict[str, Any]:
        return {"task": "tests.elsewhere", "args": [1], "kwargs": {},
                "options": {"task_id": str(uuid.uuid4()), **options}}

    try:
        republish(app, info(priority=5), recovery=True)
        assert _published(client, queue) == [("", 0, 5)]
        copy = info(priority=0, headers={FIRST_PRIORITY_HEADER: 5})  # as its row records it
        republish(app, copy)
        assert _published(client, queue) == [("3", 5, 5)]
        republish(app, copy, recovery=True)
        assert _published(client, queue) == [("", 0, 5)]
        republish(app, info(priority=0, headers={FIRST_PRIORITY_HEADER: ""}))
        assert _published(client, queue) == [("", 0, "")]  # no priority of its own: 0
        republish(app, info(priority=7))  # never recovered: as it was
        assert _published(client, queue) == [("6", 7, "absent")]
        app.conf.lease_recovery_priority = False
        republish(app, info(priority=5), recovery=True)
        assert _published(client, queue) == [("3", 5, "absent")]
        app.conf.lease_recovery_priority = 2
        republish(app, info(priority=5), recovery=True)
        assert _published(client, queue) == [("", 2, 5)]
    finally:
        for key in client.scan_iter(match=f"{queue}*"):
            client.delete(key)
