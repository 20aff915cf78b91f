"""At-least-once delivery meets the lease: real prefork workers, Redis broker, a real store.

The core scenes run twice: on the embedded SQLite store, and with two workers (different node
names) sharing one PostgreSQL store.

Every test here publishes through Redis to ``celery worker`` subprocesses with
``task_acks_late`` and ``task_reject_on_worker_lost`` on, and reads what happened from the
journal the workers write (tests/support/worker_app.py) and from the lease store itself.
"""

from __future__ import annotations

import os
import signal
import time
import uuid

import pytest

from lease_celery import LeaseRecord, LeaseState, open_store
from tests.support.workers import WorkerPool

pytestmark = pytest.mark.worker

WORK = "tests.support.worker_app.work"
UNCHECKED = "tests.support.worker_app.unchecked"
CALLBACK = "tests.support.worker_app.callback"


def _record(workers: WorkerPool, key: str) -> LeaseRecord | None:
    with open_store(workers.store_url) as store:
        return store.get(key)


def _job() -> str:
    return uuid.uuid4().hex[:10]


@pytest.mark.parametrize("worker_store", ["postgres", "mysql"], indirect=True)
@pytest.mark.worker_env(LEASE_TEST_TTL="1.5", LEASE_TEST_HEARTBEAT="0.4")
def test_same_task_published_three_times_runs_once(workers: WorkerPool) -> None:
    """Three publishes of one task id while the first runs: the body runs once, the result
    backend holds that run's result, and the deferred duplicates are dropped once it is done."""
    workers.start("a", concurrency=2)
    workers.start("b", concurrency=2)
    job, task_id = _job(), str(uuid.uuid4())
    result = workers.client.send_task(WORK, args=(job, 3.0), task_id=task_id)
    workers.journal.wait_for(lambda j: bool(j.events("body_start", job_id=job)), timeout=20,
                             what="the first run to start")
    for _ in range(2):
        workers.client.send_task(WORK, args=(job, 3.0), task_id=task_id)

    assert result.get(timeout=30) == {"job_id": job, "token": 1,
                                      "owner": workers.journal.events("body_start")[0]["owner"]}
    # Both duplicates were re-published (not lost) while the lease was live, then came back
    # and found the key done.
    workers.journal.wait_for(lambda j: len(j.events("duplicate_ignored", key=f"job:{job}")) == 2,
                             timeout=30, what="both duplicates to come back and be ignored")
    assert len(workers.journal.events("duplicate_deferred", key=f"job:{job}")) >= 2
    # The worker's log says the copy was re-published, before Celery's own "Task … ignored"
    # for the message that carried it: the work was not dropped.
    said = [line for line in workers.logs().splitlines()
            if f"job:{job}" in line and "re-published to run again in" in line]
    assert len(said) >= 2 and all("Celery logs it as ignored" in line for line in said), said
    time.sleep(1.0)  # anything still scheduled would run now
    assert len(workers.journal.events("body_start", job_id=job)) == 1
    assert result.state == "SUCCESS"
    assert result.result["token"] == 1
    record = _record(workers, f"job:{job}")
    assert record is not None and record.state is LeaseState.DONE and record.token == 1


@pytest.mark.parametrize("worker_store", ["sqlite"], indirect=True)
@pytest.mark.worker_env(LEASE_TEST_TTL="1.5", LEASE_TEST_HEARTBEAT="0.4",
                        LEASE_TEST_VISIBILITY="4")
def test_sigkilled_worker_is_taken_over_after_expiry(workers: WorkerPool) -> None:
    """The whole worker running a task is SIGKILLed: Redis redelivers the unacked message to a
    second worker, which takes the lease over once it expired (token 2) and its result is the
    one accepted."""
    doomed = workers.start("doomed", concurrency=1)
    job, task_id = _job(), str(uuid.uuid4())
    result = workers.client.send_task(WORK, args=(job, 2.5), task_id=task_id)
    workers.journal.wait_for(lambda j: bool(j.events("body_start", job_id=job)), timeout=20,
                             what="the doomed worker to start the task")
    doomed.kill()
    killed_at = time.time()
    workers.start("survivor", concurrency=1)

    assert result.get(timeout=60)["token"] == 2
    starts = workers.journal.events("body_start", job_id=job)
    assert [s["token"] for s in starts] == [1, 2]
    assert starts[1]["t"] >= killed_at + 1.0  # not before the dead owner's lease expired
    record = _record(workers, f"job:{job}")
    assert record is not None
    assert (record.state, record.token, record.attempts) == (LeaseState.DONE, 2, 2)
    assert record.result == result.result
    assert len(workers.journal.events("body_end", job_id=job)) == 1


@pytest.mark.parametrize("worker_store", ["postgres"], indirect=True)
@pytest.mark.worker_env(LEASE_TEST_TTL="1.5", LEASE_TEST_HEARTBEAT="0.4")
def test_stalled_owner_result_is_refused_and_callback_runs_once(workers: WorkerPool) -> None:
    """An owner stalled past its ttl (SIGSTOP … SIGCONT) finishes late: its result is refused,
    stale_result_rejected fires, the backend keeps the fresh result and the link callback runs
    exactly once."""
    workers.start("a", concurrency=2)
    workers.start("b", concurrency=2)
    job, task_id = _job(), str(uuid.uuid4())
    link = workers.client.signature(CALLBACK, args=(job,), immutable=False)
    result = workers.client.send_task(UNCHECKED, args=(job, 1.0), task_id=task_id, link=link)
    workers.journal.wait_for(lambda j: bool(j.events("body_start", job_id=job)), timeout=20,
                             what="the first owner to start")
    stalled_pid = workers.journal.events("body_start", job_id=job)[0]["pid"]
    os.kill(stalled_pid, signal.SIGSTOP)
    try:
        # A redelivery of the same message (as after a visibility timeout) is deferred until the
        # stalled owner's lease expires, then takes it over.
        workers.client.send_task(UNCHECKED, args=(job, 0.2), task_id=task_id, link=link)
        workers.journal.wait_for(lambda j: bool(j.events("body_end", job_id=job, token=2)),
                                 timeout=30, what="the takeover to finish")
        workers.journal.wait_for(lambda j: bool(j.events("callback", tag=job)), timeout=15,
                                 what="the fresh result's callback")
    finally:
        os.kill(stalled_pid, signal.SIGCONT)
    workers.journal.wait_for(
        lambda j: bool(j.events("stale_result_rejected", key=f"job:{job}", token=1)),
        timeout=15, what="the stale owner's result to be refused")
    time.sleep(1.0)  # a callback of the stale result would run now
    callbacks = workers.journal.events("callback", tag=job)
    assert len(callbacks) == 1
    assert callbacks[0]["result"]["token"] == 2
    assert result.get(timeout=10)["token"] == 2
    assert result.state == "SUCCESS"
    record = _record(workers, f"job:{job}")
    assert record is not None and (record.state, record.token) == (LeaseState.DONE, 2)
    assert record.result["token"] == 2


@pytest.mark.worker_env(LEASE_TEST_TTL="1", LEASE_TEST_HEARTBEAT="0.25")
def test_long_task_keeps_its_lease_through_heartbeats(workers: WorkerPool) -> None:
    """A task running 6× its ttl keeps token 1 the whole time: the heartbeat renews it and no
    duplicate can take it over meanwhile."""
    workers.start("a", concurrency=2)
    job, task_id = _job(), str(uuid.uuid4())
    result = workers.client.send_task(WORK, args=(job, 6.0), task_id=task_id)
    workers.journal.wait_for(lambda j: bool(j.events("body_start", job_id=job)), timeout=20,
                             what="the task to start")
    time.sleep(2.5)  # well past the first ttl: a duplicate now must still be deferred
    workers.client.send_task(WORK, args=(job, 6.0), task_id=task_id)
    assert result.get(timeout=30)["token"] == 1
    assert not workers.journal.events("body_lease_lost", job_id=job)
    assert len(workers.journal.events("body_start", job_id=job)) == 1
    assert workers.journal.events("duplicate_deferred", key=f"job:{job}")


@pytest.mark.worker_env(LEASE_TEST_TTL="1", LEASE_TEST_HEARTBEAT="0.25")
def test_refused_renewal_makes_check_raise_lease_lost(workers: WorkerPool) -> None:
    """When the store refuses a renewal (here: another owner took the key over), the running
    body's ``self.lease.check()`` raises LeaseLost and the lost lease's failure is not stored
    over the new owner's lease."""
    workers.start("a", concurrency=1)
    job, task_id = _job(), str(uuid.uuid4())
    result = workers.client.send_task(WORK, args=(job, 8.0), task_id=task_id)
    workers.journal.wait_for(lambda j: bool(j.events("body_start", job_id=job)), timeout=20,
                             what="the task to start")
    # An intruder waits out a (simulated) lapse: push the row's deadline into the past, then
    # claim the key as another owner, exactly as a takeover after a missed renewal would.
    import sqlite3

    path = workers.store_url.removeprefix("sqlite:///")
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE lease_celery_leases SET expires_at = 0 WHERE key = ?",
                     (f"job:{job}",))
    with open_store(workers.store_url) as store:
        intruder = store.claim(f"job:{job}", owner="intruder", ttl=60)
    assert intruder is not None and intruder.token == 2
    workers.journal.wait_for(lambda j: bool(j.events("body_lease_lost", job_id=job)),
                             timeout=10, what="the body to see LeaseLost")
    workers.journal.wait_for(
        lambda j: bool(j.events("stale_result_rejected", key=f"job:{job}", token=1)),
        timeout=10, what="the lost owner's failure to be dropped")
    assert workers.journal.events("lease_lost", key=f"job:{job}", token=1)
    assert result.state == "PENDING"  # neither FAILURE nor SUCCESS was written for token 1
    record = _record(workers, f"job:{job}")
    assert record is not None and (record.owner, record.token) == ("intruder", 2)


@pytest.mark.worker_env(LEASE_TEST_TTL="2", LEASE_TEST_HEARTBEAT="0.5",
                        LEASE_TEST_FAULTY_RECEIVERS="1")
def test_celery_retry_releases_and_reclaims_with_faulty_receivers(workers: WorkerPool) -> None:
    """``self.retry()`` keeps working: each attempt releases the lease and the retried message
    claims it again with the next token; receivers that raise never break the task."""
    workers.start("a", concurrency=2)
    job = _job()
    result = workers.client.send_task("tests.support.worker_app.flaky", args=(job, 2))
    assert result.get(timeout=30) == {"job_id": job, "token": 3, "retries": 2}
    starts = workers.journal.events("body_start", job_id=job)
    assert [(s["token"], s["retries"]) for s in starts] == [(1, 0), (2, 1), (3, 2)]
    assert len(workers.journal.events("lease_released", key=f"job:{job}")) == 2
    record = _record(workers, f"job:{job}")
    assert record is not None and (record.state, record.token) == (LeaseState.DONE, 3)


@pytest.mark.worker_env(LEASE_TEST_TTL="2", LEASE_TEST_HEARTBEAT="0.5")
def test_non_json_result_fails_the_task_and_kills_the_key(workers: WorkerPool) -> None:
    """A result the store cannot hold fails the task with ResultNotSerializable, a permanent
    error: the key goes dead with the reason (not left running until expiry, not done)."""
    workers.start("a", concurrency=1)
    job = _job()
    result = workers.client.send_task("tests.support.worker_app.not_json", args=(job,))
    with pytest.raises(Exception, match="JSON-serializable"):
        result.get(timeout=30)
    record = _record(workers, f"job:{job}")
    assert record is not None and (record.state, record.token) == (LeaseState.DEAD, 1)
    assert "ResultNotSerializable" in (record.reason or "")


def test_unavailable_store_defers_the_delivery_instead_of_losing_it(
        workers: WorkerPool) -> None:
    """While the SQLite store stays locked longer than its busy_timeout the claim fails with
    StoreBusy: the delivery is re-published, not failed and acked, and runs once the store
    answers again."""
    import sqlite3

    locked_url = workers.store_url + "?busy_timeout=0.3"
    workers.env["LEASE_TEST_STORE"] = locked_url
    path = workers.store_url.removeprefix("sqlite:///")
    open_store(locked_url).get("warm-up")  # create the schema before we lock the file
    blocker = sqlite3.connect(path, isolation_level=None)
    blocker.execute("BEGIN EXCLUSIVE")
    try:
        workers.start("a", concurrency=1)
        job = _job()
        result = workers.client.send_task(WORK, args=(job, 0.0))
        workers.journal.wait_for(lambda j: bool(j.events("duplicate_deferred", key=f"job:{job}")),
                                 timeout=20, what="the delivery to be deferred")
        assert "lease store failed" in workers.journal.events("duplicate_deferred")[0]["reason"]
        assert not workers.journal.events("body_start", job_id=job)
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
    assert result.get(timeout=30)["token"] == 1
    assert len(workers.journal.events("body_start", job_id=job)) == 1


def _business_rows(store_url: str, job: str) -> list[int]:
    import sqlite3

    with open_store(store_url) as store:
        if store_url.startswith("sqlite"):
            with sqlite3.connect(store_url.removeprefix("sqlite:///")) as conn:
                rows = conn.execute("SELECT token FROM biz_writes WHERE job_id = ?", (job,))
                return [token for (token,) in rows]
        import psycopg

        with psycopg.connect(store_url.split("?")[0]) as conn:
            cursor = conn.execute(
                f'SELECT token FROM "{store.schema}".biz_writes WHERE job_id = %s', (job,))
            return [token for (token,) in cursor]


@pytest.mark.parametrize("worker_store", ["sqlite", "postgres"], indirect=True)
@pytest.mark.worker_env(LEASE_TEST_TTL="1.5", LEASE_TEST_HEARTBEAT="0.4")
def test_stale_worker_business_write_is_rolled_back(workers: WorkerPool) -> None:
    """Two generations write a business row through ``self.lease.fenced()``: the fresh owner's
    row commits; the stalled owner's write raises LeaseLost and leaves nothing behind."""
    workers.start("a", concurrency=2)
    workers.start("b", concurrency=2)
    job, task_id = _job(), str(uuid.uuid4())
    workers.client.send_task("tests.support.worker_app.fenced_write", args=(job, 1.0),
                             task_id=task_id)
    workers.journal.wait_for(lambda j: bool(j.events("body_start", job_id=job)), timeout=20,
                             what="the first owner to start")
    stalled_pid = workers.journal.events("body_start", job_id=job)[0]["pid"]
    os.kill(stalled_pid, signal.SIGSTOP)
    try:
        result = workers.client.send_task("tests.support.worker_app.fenced_write", args=(job, 0.1),
                                          task_id=task_id)
        workers.journal.wait_for(
            lambda j: bool(j.events("fenced_committed", job_id=job, token=2)), timeout=30,
            what="the fresh owner's fenced write")
    finally:
        os.kill(stalled_pid, signal.SIGCONT)
    workers.journal.wait_for(lambda j: bool(j.events("fenced_refused", job_id=job, token=1)),
                             timeout=15, what="the stale owner's fenced write to be refused")
    assert result.get(timeout=10) == {"job_id": job, "token": 2}
    assert _business_rows(workers.store_url, job) == [2]


@pytest.mark.worker_env(LEASE_TEST_TTL="2", LEASE_TEST_HEARTBEAT="0.5",
                        LEASE_TEST_VISIBILITY="2", LEASE_TEST_EXTEND_VISIBILITY="1")
def test_extended_visibility_keeps_a_running_task_from_coming_back_on_redis(
        workers: WorkerPool) -> None:
    """A 5 s body under a 2 s visibility timeout on the Redis broker, two workers, with
    ``lease_extend_visibility``: the worker moves the message's score in kombu's unacked index
    while the lease is renewed, so kombu never hands it to the other worker: received once,
    no deferral, one run. (Without it the message comes back every 2 s: at least once more in
    each run when this test was written, as it does on SQS in tests/workers/test_sqs.py.)"""
    workers.start("a", concurrency=1)
    workers.start("b", concurrency=1)
    job, task_id = _job(), str(uuid.uuid4())
    result = workers.client.send_task(WORK, args=(job, 5.0), task_id=task_id)
    assert result.get(timeout=40)["token"] == 1
    time.sleep(2.5)
    received = workers.journal.events("task_received", task_id=task_id)
    assert len(received) == 1, received
    assert workers.journal.events("duplicate_deferred", key=f"job:{job}") == []
    assert len(workers.journal.events("body_start", job_id=job)) == 1
