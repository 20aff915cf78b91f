"""``lease_record_at_publish``: a row from the moment of publish, so that a message the broker
loses before anyone claimed it still runs (lease_celery.execution.published).

Real workers on a Redis broker (ttl 2 s, sweep every 0.5 s, grace 2 s); the publisher is an app
of the test's own (tests/support/publisher.py), in this process or in processes of its own.
A message is lost by deleting it from the broker's list (LREM), as a worker killed between
kombu's pop and its unacked record, a failover or a purge would.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import redis

from lease_celery import LeaseState, open_store
from tests.support.publisher import NAME, publisher
from tests.support.servers import REDIS_URL
from tests.support.tokens import token_base
from tests.support.workers import REPO, WorkerPool

GRACE, INTERVAL = 2.0, 0.5
ENV = {"LEASE_TEST_TTL": "2", "LEASE_TEST_HEARTBEAT": "0.5",
       "LEASE_TEST_SWEEP_INTERVAL": str(INTERVAL), "LEASE_TEST_SWEEP_GRACE": str(GRACE)}


def _job() -> str:
    return uuid.uuid4().hex[:10]


def _delete_from_broker(workers: WorkerPool, task_ids: set[str]) -> int:
    """LREM the messages of these task ids from the workers' queue; how many were there."""
    client = redis.Redis.from_url(REDIS_URL)
    queue = workers.env["LEASE_TEST_QUEUE"]
    removed = 0
    for raw in client.lrange(queue, 0, -1):
        if json.loads(raw)["headers"]["id"] in task_ids:
            removed += int(client.lrem(queue, 1, raw))
    return removed


def _run_publisher(workers: WorkerPool, job: str, *args: str,
                   task_id: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tests.support.publisher", REDIS_URL,
         workers.env["LEASE_TEST_QUEUE"], workers.store_url, task_id, job, *args],
        cwd=REPO, capture_output=True, text=True, timeout=60)


@pytest.mark.worker
@pytest.mark.worker_env(**ENV)
def test_a_message_the_broker_lost_still_runs_once(workers: WorkerPool) -> None:
    """Two messages deleted from the broker before any worker saw them: the one published
    with ``lease_record=True`` runs once, under the key's first token, about a grace period
    plus a sweep after it became claimable; the one published without a row is lost for good
    (what every message was before)."""
    task = publisher(REDIS_URL, workers.env["LEASE_TEST_QUEUE"], workers.store_url)
    kept, control = _job(), _job()
    recorded = task.apply_async((kept, 0.1), lease_record=True)
    unrecorded = task.apply_async((control, 0.1))
    published_at = time.time()
    with open_store(workers.store_url) as store:
        row = store.get(f"job:{kept}")
        assert row is not None and (row.state, row.task_id) == (LeaseState.READY, recorded.id)
        assert store.get(f"job:{control}") is None
    assert _delete_from_broker(workers, {recorded.id, unrecorded.id}) == 2
    workers.start("a", concurrency=2)
    assert recorded.get(timeout=30)["token"] == token_base(workers.store_url) + 1
    starts = workers.journal.events("body_start", job_id=kept)
    assert [s["task_id"] for s in starts] == [recorded.id]
    # Claimable at publish: due a grace later, re-published by the first sweep after that.
    assert starts[0]["t"] - published_at < max(GRACE, time.time() - published_at) + 5
    assert [e["key"] for e in workers.journal.events("lease_swept")] == [f"job:{kept}"]
    time.sleep(GRACE + 2 * INTERVAL)
    assert workers.journal.events("body_start", job_id=control) == []
    assert len(workers.journal.events("body_start", job_id=kept)) == 1
    with open_store(workers.store_url) as store:
        done = store.get(f"job:{kept}")
        assert done is not None and done.state is LeaseState.DONE
        assert store.get(f"job:{control}") is None


@pytest.mark.worker
@pytest.mark.worker_env(**ENV)
def test_a_publisher_killed_between_the_row_and_the_publish_is_recovered(
        workers: WorkerPool) -> None:
    """The publisher process is SIGKILLed once its row is written, as the message was about
    to go to the broker: no message ever existed, and the task still runs, once, with the
    task id the publisher chose, a grace period after the publish."""
    workers.start("a", concurrency=2)
    job, task_id = _job(), str(uuid.uuid4())
    died = _run_publisher(workers, job, "--die-before-publish", task_id=task_id)
    assert died.returncode == -9, died.stderr
    died_at = time.time()
    with open_store(workers.store_url) as store:
        row = store.get(f"job:{job}")
        assert row is not None and (row.state, row.task_id) == (LeaseState.READY, task_id)
    workers.journal.wait_for(lambda j: bool(j.events("body_end", job_id=job)), timeout=20,
                             what="the recovered task to run")
    starts = workers.journal.events("body_start", job_id=job)
    assert [s["task_id"] for s in starts] == [task_id]
    assert GRACE - 0.5 < starts[0]["t"] - died_at < GRACE + INTERVAL + 2.0
    assert workers.client.AsyncResult(task_id).get(timeout=10)["job_id"] == job
    assert [e["task_id"] for e in workers.journal.events("task_received")
            if e["task"] == NAME] == [task_id]


# The sweeper is not this test's subject: under three test processes a publisher process took
# more than the 2 s grace from its row to its message (its first connection to the broker), and
# the sweeper rightly re-published rows it found with an empty queue (CI: 7 messages for 4).
@pytest.mark.worker
@pytest.mark.worker_env(**{**ENV, "LEASE_TEST_SWEEP_GRACE": "60"})
def test_two_unique_publishers_at_once_publish_once(workers: WorkerPool) -> None:
    """Two publisher processes publish the same keys at the same instant with
    ``lease_unique`` and ``lease_record``: for each key the row's conditional write picks one
    of them, the other gets its ``AsyncResult``; one message per key, one run."""
    workers.start("a", concurrency=2)
    jobs = [_job() for _ in range(4)]
    at = time.time() + 3.0
    procs = [[subprocess.Popen(
        [sys.executable, "-m", "tests.support.publisher", REDIS_URL,
         workers.env["LEASE_TEST_QUEUE"], workers.store_url, "", job, "--unique",
         "--at", str(at)], cwd=REPO, stdout=subprocess.PIPE, text=True) for _ in range(2)]
        for job in jobs]
    for job, pair in zip(jobs, procs, strict=True):
        ids = [p.communicate(timeout=60)[0].strip() for p in pair]
        assert all(p.returncode == 0 for p in pair)
        assert ids[0] == ids[1], (job, ids)
        workers.journal.wait_for(lambda j, job=job: bool(j.events("body_end", job_id=job)),
                                 timeout=20, what=f"{job} to run")
        assert [s["task_id"] for s in workers.journal.events("body_start", job_id=job)] == [
            ids[0]]
    received = [e["task_id"] for e in workers.journal.events("task_received")
                if e["task"] == NAME]
    assert len(received) == len(jobs)


@pytest.mark.parametrize("keyprefix", ["", "lease-tests-prefix-{run}:"],
                         ids=["plain", "global_keyprefix"])
def test_a_ready_row_whose_queue_holds_messages_waits_for_them(tmp_path: Path,
                                                                keyprefix: str) -> None:
    """The sweeper asks the broker how many messages wait in a ready row's queue: while some
    do (the row's message may be one of them), the row is left for a later sweep, at most
    ``QUEUE_WAIT_GRACES`` grace periods; once the queue is empty it is re-published. Real
    Redis broker, also with kombu's ``global_keyprefix`` (whose passive queue check looks for
    the key without the prefix, so the queue seemed missing and the row was re-published
    behind its backlog every grace period); a SQLite store on an injected clock."""
    from celery import Celery

    from lease_celery.worker.sweeper import QUEUE_WAIT_GRACES, sweep_report

    run = uuid.uuid4().hex[:8]
    queue, keyprefix = f"lease-tests-backlog-{run}", keyprefix.format(run=run)
    app = Celery("backlog", broker=REDIS_URL, set_as_current=False)
    app.conf.task_default_queue = queue
    if keyprefix:
        app.conf.broker_transport_options = {"global_keyprefix": keyprefix}
    now = [1000.0]
    client = redis.Redis.from_url(REDIS_URL)
    info = {"task": NAME, "args": ["j", 0.1], "kwargs": {},
            "options": {"task_id": str(uuid.uuid4())}}
    try:
        with open_store(f"sqlite:///{tmp_path / 'leases.sqlite3'}",
                        clock=lambda: now[0]) as store:
            assert store.record_published("job:j", task=info)
            for n in range(3):  # the backlog the row's message waits behind
                app.send_task("other.task", args=(n,), queue=queue)
            now[0] += 2.5
            report = sweep_report(app, store, grace=2.0)
            assert [(r.key, n) for r, n in report.waiting] == [("job:j", 3)]
            assert report.republished == []
            now[0] += 2.5  # still waiting: left alone again
            assert [n for _, n in sweep_report(app, store, grace=2.0).waiting] == [3]
            now[0] = 1000.0 + QUEUE_WAIT_GRACES * 2.0  # waited long enough: re-published
            assert [r.key for r in sweep_report(app, store, grace=2.0).republished] == [
                "job:j"]
            assert client.llen(keyprefix + queue) == 4
            client.delete(keyprefix + queue)
            now[0] += 2.5  # an empty queue: re-published at once when due
            assert [r.key for r in sweep_report(app, store, grace=2.0).republished] == [
                "job:j"]
    finally:
        client.delete(keyprefix + queue)
        for key in client.scan_iter(match=f"{keyprefix}*") if keyprefix else ():
            client.delete(key)


@pytest.mark.worker
@pytest.mark.worker_env(**ENV)
def test_a_group_of_recorded_tasks_publishes_and_runs_each_once(workers: WorkerPool) -> None:
    """Celery's canvas hands every member of a group its producer (and a chain its own
    options): none of that machinery is recorded, a queue object is recorded by its name, and
    each member's row is written and run once."""
    from celery import group
    from kombu.entity import Queue

    task = publisher(REDIS_URL, workers.env["LEASE_TEST_QUEUE"], workers.store_url)
    workers.start("a", concurrency=2)
    jobs = [_job() for _ in range(3)]
    queue = Queue(workers.env["LEASE_TEST_QUEUE"])
    results = group(task.s(job, 0.1).set(lease_record=True, queue=queue)
                    for job in jobs).apply_async()
    assert sorted(r["job_id"] for r in results.get(timeout=30)) == sorted(jobs)
    with open_store(workers.store_url) as store:
        for job in jobs:
            record = store.get(f"job:{job}")
            assert record is not None and record.state is LeaseState.DONE
            assert len(workers.journal.events("body_start", job_id=job)) == 1


@pytest.mark.worker
@pytest.mark.worker_env(**ENV)
def test_a_message_dropped_unrun_takes_its_row_and_a_failed_publish_too(
        workers: WorkerPool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A recorded message that expires before a worker takes it is dropped by Celery unrun
    (``task_revoked``, which a revoked message sends too): its row goes with it, and the
    sweeper does not bring it back grace after grace. A publish that raises takes its row
    back: the caller heard of the failure, nothing runs behind its back."""
    task = publisher(REDIS_URL, workers.env["LEASE_TEST_QUEUE"], workers.store_url)
    expired, failed = _job(), _job()
    task.apply_async((expired, 0.1), lease_record=True, expires=0.5)
    time.sleep(1.0)
    workers.start("a", concurrency=2)
    with open_store(workers.store_url) as store:
        deadline = time.monotonic() + 10
        while store.get(f"job:{expired}") is not None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert store.get(f"job:{expired}") is None
    time.sleep(GRACE + 3 * INTERVAL)
    assert workers.journal.events("body_start", job_id=expired) == []
    assert workers.journal.events("lease_swept") == []

    def refuse(*args: object, **kwargs: object) -> None:
        raise ConnectionError("the broker is down")

    monkeypatch.setattr(task.app.amqp, "send_task_message", refuse)
    from kombu.exceptions import OperationalError

    with pytest.raises(OperationalError, match="the broker is down"):  # Celery wraps it
        task.apply_async((failed, 0.1), lease_record=True)
    with open_store(workers.store_url) as store:
        assert store.get(f"job:{failed}") is None
