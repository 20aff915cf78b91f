"""The worker scenarios on RabbitMQ: real prefork workers, an ``amqp://`` broker on a vhost of
this module's own, ``rpc://`` results, a SQLite lease store.

What differs from Redis (tests/workers/test_worker_delivery.py) is how a message comes back.
RabbitMQ
has no visibility timeout: it hands an unacked message out again when the channel holding it
closes (the worker's connection dropped, or missed AMQP heartbeats), or past
``consumer_timeout`` (30 min by default). A worker that is alive but whose pool process stalls
keeps its message unacked; the lease sweeper is then what brings the task back. The journal
(what the workers saw) stays on Redis.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from celery import Celery

from lease_celery import LeaseRecord, LeaseState, open_store
from tests.support.backlog import BACKLOG, stalled_owner_behind_a_backlog
from tests.support.rabbitmq import private_vhost
from tests.support.servers import REDIS_URL
from tests.support.tokens import token_base
from tests.support.workers import Journal, WorkerPool, broker_env, client_pool

pytestmark = pytest.mark.worker

WORK = "tests.support.worker_app.work"
UNCHECKED = "tests.support.worker_app.unchecked"
CALLBACK = "tests.support.worker_app.callback"


@pytest.fixture(scope="module")
def broker_url() -> Iterator[str]:
    """An ``amqp://`` URL on a vhost of this module's own, deleted after its tests."""
    with private_vhost("lease_test_workers") as url:
        yield url


@pytest.fixture
def workers(request: pytest.FixtureRequest, tmp_path: Path, redis_client: redis.Redis,
            broker_url: str, worker_store: str) -> Iterator[WorkerPool]:
    """Real celery workers on RabbitMQ (a queue of this test's own, ``rpc://`` results), a
    SQLite store and a journal of this test's own. ``worker_env`` overrides settings."""
    env = broker_env(request, broker_url=broker_url, result_backend="rpc://",
                     journal_redis=REDIS_URL, worker_store=worker_store)
    journal = Journal(redis_client, env["LEASE_TEST_JOURNAL"])
    client = Celery("lease-tests-rabbitmq", broker=broker_url, backend="rpc://",
                    set_as_current=False)
    client.conf.task_default_queue = env["LEASE_TEST_QUEUE"]
    with client_pool(request, tmp_path, env, journal, client, worker_store) as pool:
        yield pool


def _record(workers: WorkerPool, key: str) -> LeaseRecord | None:
    with open_store(workers.store_url) as store:
        return store.get(key)


def _job() -> str:
    return uuid.uuid4().hex[:10]


@pytest.mark.worker_env(LEASE_TEST_TTL="1.5", LEASE_TEST_HEARTBEAT="0.4")
def test_same_task_published_three_times_runs_once(workers: WorkerPool) -> None:
    """Three publishes of one task id while the first runs: the body runs once, the publisher
    gets that run's result over ``rpc://`` (another client sees PENDING), and both duplicates
    were deferred (re-published with a countdown, which RabbitMQ workers hold unacked) and
    dropped once it was done."""
    workers.start("a", concurrency=2)
    workers.start("b", concurrency=2)
    job, task_id = _job(), str(uuid.uuid4())
    result = workers.client.send_task(WORK, args=(job, 3.0), task_id=task_id)
    workers.journal.wait_for(lambda j: bool(j.events("body_start", job_id=job)), timeout=20,
                             what="the first run to start")
    for _ in range(2):
        workers.client.send_task(WORK, args=(job, 3.0), task_id=task_id)

    owner = workers.journal.events("body_start", job_id=job)[0]["owner"]
    assert result.get(timeout=30) == {"job_id": job, "token": 1, "owner": owner}
    workers.journal.wait_for(lambda j: len(j.events("duplicate_ignored", key=f"job:{job}")) == 2,
                             timeout=30, what="both duplicates to come back and be ignored")
    assert len(workers.journal.events("duplicate_deferred", key=f"job:{job}")) >= 2
    time.sleep(1.0)  # anything still scheduled would run now
    assert len(workers.journal.events("body_start", job_id=job)) == 1
    assert result.state == "SUCCESS"
    # rpc:// (what doctor says): the result went to the publisher's reply queue only; another
    # client asking for the same id sees PENDING.
    other = Celery("lease-tests-other", broker=workers.client.conf.broker_url,
                   backend="rpc://", set_as_current=False)
    try:
        assert other.AsyncResult(task_id).state == "PENDING"
    finally:
        other.close()
    record = _record(workers, f"job:{job}")
    assert record is not None and (record.state, record.token) == (LeaseState.DONE, 1)


@pytest.mark.worker_env(LEASE_TEST_TTL="1.5", LEASE_TEST_HEARTBEAT="0.4",
                        LEASE_TEST_SWEEP_INTERVAL="0")
def test_sigkilled_worker_message_is_redelivered_and_taken_over(workers: WorkerPool) -> None:
    """The whole worker running a task is SIGKILLed: its connection drops and RabbitMQ puts
    the unacked message (acks_late) back at once; a second worker receives it, takes the lease
    over once the dead owner's expired (token 2), and its result is the one accepted. The
    sweeper is off, so the broker's redelivery is the only way back."""
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
    assert len(workers.journal.events("task_received", task_id=task_id)) >= 2
    assert not workers.journal.events("lease_swept", key=f"job:{job}")
    record = _record(workers, f"job:{job}")
    assert record is not None
    assert (record.state, record.token, record.attempts) == (LeaseState.DONE, 2, 2)
    assert record.result == result.result
    assert len(workers.journal.events("body_end", job_id=job)) == 1


@pytest.mark.worker_env(LEASE_TEST_TTL="1.5", LEASE_TEST_HEARTBEAT="0.4")
def test_stalled_pool_process_is_swept_and_its_result_refused(workers: WorkerPool) -> None:
    """A pool process stalled past its ttl (SIGSTOP … SIGCONT) while its worker's main process
    stays connected: RabbitMQ keeps the message unacked at that worker (it would until
    consumer_timeout), so the lease sweeper re-publishes the task and another worker takes it
    over (token 2). The stalled process, resumed, has its result refused; the publisher gets
    the fresh result and the link callback runs once."""
    workers.start("a", concurrency=1)
    job, task_id = _job(), str(uuid.uuid4())
    link = workers.client.signature(CALLBACK, args=(job,), immutable=False)
    result = workers.client.send_task(UNCHECKED, args=(job, 1.0), task_id=task_id, link=link)
    workers.journal.wait_for(lambda j: bool(j.events("body_start", job_id=job)), timeout=20,
                             what="the first owner to start")
    stalled_pid = workers.journal.events("body_start", job_id=job)[0]["pid"]
    os.kill(stalled_pid, signal.SIGSTOP)
    try:
        workers.start("b", concurrency=1)
        workers.journal.wait_for(lambda j: bool(j.events("body_end", job_id=job, token=2)),
                                 timeout=30, what="the takeover to finish")
        workers.journal.wait_for(lambda j: bool(j.events("callback", tag=job)), timeout=15,
                                 what="the fresh result's callback")
    finally:
        os.kill(stalled_pid, signal.SIGCONT)
    workers.journal.wait_for(
        lambda j: bool(j.events("stale_result_rejected", key=f"job:{job}", token=1)),
        timeout=15, what="the stale owner's result to be refused")
    assert workers.journal.events("lease_swept", key=f"job:{job}")
    time.sleep(1.0)  # a callback of the stale result would run now
    callbacks = workers.journal.events("callback", tag=job)
    assert [c["result"]["token"] for c in callbacks] == [2]
    assert result.get(timeout=10)["token"] == 2
    record = _record(workers, f"job:{job}")
    assert record is not None and (record.state, record.token) == (LeaseState.DONE, 2)
    assert record.result["token"] == 2


@pytest.mark.worker_env(LEASE_TEST_TTL="1.5", LEASE_TEST_HEARTBEAT="0.4",
                        LEASE_TEST_SWEEP_INTERVAL="0")
def test_stalled_worker_misses_heartbeats_and_is_taken_over(workers: WorkerPool) -> None:
    """A whole worker (main process and pool) stalled past its ttl: with 2 s AMQP heartbeats
    RabbitMQ closes its connection and hands the unacked message to another worker, which
    takes the lease over (token 2; the sweeper is off). Resumed, the stalled worker finishes
    the body late: its result is refused, and the publisher gets token 2's."""
    stalled = workers.start("stalled", concurrency=1,
                            extra_env={"LEASE_TEST_BROKER_HEARTBEAT": "2"})
    job, task_id = _job(), str(uuid.uuid4())
    result = workers.client.send_task(UNCHECKED, args=(job, 1.0), task_id=task_id)
    workers.journal.wait_for(lambda j: bool(j.events("body_start", job_id=job)), timeout=20,
                             what="the first owner to start")
    os.killpg(stalled.process.pid, signal.SIGSTOP)
    stopped_at = time.time()
    try:
        workers.start("b", concurrency=1)
        workers.journal.wait_for(lambda j: bool(j.events("body_end", job_id=job, token=2)),
                                 timeout=40, what="RabbitMQ's redelivery to be taken over")
    finally:
        os.killpg(stalled.process.pid, signal.SIGCONT)
    workers.journal.wait_for(
        lambda j: bool(j.events("stale_result_rejected", key=f"job:{job}", token=1)),
        timeout=15, what="the stalled worker's result to be refused")
    starts = workers.journal.events("body_start", job_id=job)
    assert [s["token"] for s in starts] == [1, 2]
    print(f"redelivered and taken over {starts[1]['t'] - stopped_at:.1f}s after SIGSTOP")
    assert result.get(timeout=10)["token"] == 2
    record = _record(workers, f"job:{job}")
    assert record is not None and (record.state, record.token) == (LeaseState.DONE, 2)


@pytest.mark.worker_env(LEASE_TEST_TTL="1", LEASE_TEST_HEARTBEAT="0.25")
def test_long_task_keeps_its_lease_through_heartbeats(workers: WorkerPool) -> None:
    """A task running 6× its ttl keeps token 1 the whole time: the heartbeat renews it and a
    duplicate sent well past the first ttl is deferred, not run."""
    workers.start("a", concurrency=2)
    job, task_id = _job(), str(uuid.uuid4())
    result = workers.client.send_task(WORK, args=(job, 6.0), task_id=task_id)
    workers.journal.wait_for(lambda j: bool(j.events("body_start", job_id=job)), timeout=20,
                             what="the task to start")
    time.sleep(2.5)
    workers.client.send_task(WORK, args=(job, 6.0), task_id=task_id)
    assert result.get(timeout=30)["token"] == 1
    assert not workers.journal.events("body_lease_lost", job_id=job)
    assert len(workers.journal.events("body_start", job_id=job)) == 1
    assert workers.journal.events("duplicate_deferred", key=f"job:{job}")
    workers.journal.wait_for(lambda j: bool(j.events("duplicate_ignored", key=f"job:{job}")),
                             timeout=15, what="the deferred duplicate to be dropped")


@pytest.mark.worker_env(LEASE_TEST_TTL="2", LEASE_TEST_HEARTBEAT="0.5",
                        LEASE_TEST_SWEEP_INTERVAL="0.5", LEASE_TEST_SWEEP_GRACE="2")
def test_a_purged_queue_loses_no_task_recorded_at_publish(workers: WorkerPool,
                                                          broker_url: str) -> None:
    """``lease_record_at_publish`` on RabbitMQ: the queue is purged before any worker saw
    its messages; the task published with a row runs once (the sweeper counts the queue
    empty, on a channel of its own, and re-publishes the row), the one without stays lost."""
    from kombu import Connection

    from tests.support.publisher import publisher

    queue = workers.env["LEASE_TEST_QUEUE"]
    task = publisher(broker_url, queue, workers.store_url, backend="rpc://")
    kept, lost = _job(), _job()
    task.apply_async((kept, 0.1), lease_record=True)
    task.apply_async((lost, 0.1))
    with Connection(broker_url) as conn:
        assert conn.default_channel.queue_purge(queue) == 2
    task.app.close()
    workers.start("a", concurrency=2)
    workers.journal.wait_for(lambda j: bool(j.events("body_end", job_id=kept)), timeout=20,
                             what="the purged, recorded task to run")
    time.sleep(3.0)  # a grace and more: nothing brings the other one back
    assert len(workers.journal.events("body_start", job_id=kept)) == 1
    assert workers.journal.events("body_start", job_id=lost) == []
    record = _record(workers, f"job:{kept}")
    assert record is not None and record.state is LeaseState.DONE
    assert _record(workers, f"job:{lost}") is None


@pytest.mark.worker_env(LEASE_TEST_TTL="2", LEASE_TEST_HEARTBEAT="0.5",
                        LEASE_TEST_SWEEP_INTERVAL="0.5", LEASE_TEST_QUEUE_MAX_PRIORITY="10")
def test_a_stalled_owners_key_runs_again_ahead_of_the_backlog(workers: WorkerPool) -> None:
    """As on Redis (tests/workers/test_worker_recovery.py): a pool process SIGSTOPped holding a
    lease, 40 tasks queued behind it at priority 5, in a queue declared with x-max-priority 10
    (``task_queue_max_priority``, on the publisher too: RabbitMQ refuses a declaration whose
    arguments differ). The sweeper re-publishes the expired key at priority 10: it runs
    again before most of the backlog, where it used to wait behind all 40."""
    workers.client.conf.task_queue_max_priority = 10
    recovery = stalled_owner_behind_a_backlog(workers)
    print(recovery)  # the figures (pytest -s)
    assert recovery.token == token_base(workers.store_url) + 2
    assert recovery.started_before < BACKLOG // 2, recovery
