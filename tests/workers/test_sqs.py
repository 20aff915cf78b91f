"""The worker scenarios on SQS, the visibility-timeout broker: real prefork workers, kombu's SQS
transport against moto's SQS server (tests/support/sqs.py), Redis results, a SQLite store.

SQS hands a message that was not deleted within its visibility timeout to another consumer,
whether or not its first consumer still runs it: that redelivery is by design, and the lease
is what meets it. The journal (what the workers saw) stays on Redis.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

from benchmarks.chaos.workers import pool_children
from lease_celery import LeaseState, open_store
from tests.support.servers import REDIS_URL, missing
from tests.support.sqs import broker_url, sqs_client, sqs_port, transport_options
from tests.support.tokens import token_base
from tests.support.workers import Journal, WorkerPool, broker_env, client_pool

pytestmark = pytest.mark.worker

WORK = "tests.support.worker_app.work"
EXTENDED = "tests.support.worker_app.work_extended"
QUICK = "tests.support.worker_app.settle_quick"
CALLBACK = "tests.support.worker_app.callback"


@pytest.fixture(scope="module")
def sqs() -> int:
    port, why = sqs_port()
    if port is None:
        missing(f"no SQS server: {why}")
    return port


@pytest.fixture
def workers(request: pytest.FixtureRequest, tmp_path: Path, redis_client: redis.Redis,
            sqs: int, worker_store: str) -> Iterator[WorkerPool]:
    """Real celery workers on an SQS queue of this test's own (deleted after), Redis results,
    a SQLite store and a journal of this test's own. ``worker_env`` overrides settings."""
    env = broker_env(request, broker_url=broker_url(sqs), result_backend=REDIS_URL,
                     journal_redis=REDIS_URL, worker_store=worker_store)
    journal = Journal(redis_client, env["LEASE_TEST_JOURNAL"])
    client = Celery("lease-tests-sqs", broker=env["LEASE_TEST_BROKER"], backend=REDIS_URL,
                    set_as_current=False)
    client.conf.task_default_queue = env["LEASE_TEST_QUEUE"]
    client.conf.broker_transport_options = transport_options(
        float(env.get("LEASE_TEST_VISIBILITY", "3600")))
    try:
        with client_pool(request, tmp_path, env, journal, client, worker_store) as pool:
            yield pool
    finally:
        server = sqs_client(sqs)
        for url in server.list_queues(QueueNamePrefix=env["LEASE_TEST_QUEUE"]).get(
                "QueueUrls", []):
            server.delete_queue(QueueUrl=url)


def _job() -> str:
    return uuid.uuid4().hex[:10]


def _queue_empty(workers: WorkerPool, port: int) -> bool:
    """Nothing left in the test's queue: no message waiting, in flight or delayed."""
    client = sqs_client(port)
    url = client.get_queue_url(QueueName=workers.env["LEASE_TEST_QUEUE"])["QueueUrl"]
    counts = client.get_queue_attributes(QueueUrl=url, AttributeNames=["All"])["Attributes"]
    return all(int(counts[name]) == 0 for name in (
        "ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible",
        "ApproximateNumberOfMessagesDelayed"))


def _started_on_one_of_two(workers: WorkerPool,
                           seconds: float) -> tuple[str, str, Any, dict[str, Any]]:
    """Two workers ``-c 1``, one task of ``seconds`` published: (job, task id, its
    AsyncResult, the journal's body_start of its first run) once that run started."""
    workers.start("a", concurrency=1)
    workers.start("b", concurrency=1)
    job, task_id = _job(), str(uuid.uuid4())
    result = workers.client.send_task(WORK, args=(job, seconds), task_id=task_id)
    workers.journal.wait_for(lambda j: bool(j.events("body_start", job_id=job)), timeout=20,
                             what="the first run to start")
    return job, task_id, result, workers.journal.events("body_start", job_id=job)[0]


def _received(workers: WorkerPool, task_id: str) -> list[dict[str, Any]]:
    return workers.journal.events("task_received", task_id=task_id)


@pytest.mark.worker_env(LEASE_TEST_TTL="2", LEASE_TEST_HEARTBEAT="0.5",
                        LEASE_TEST_VISIBILITY="2")
def test_a_body_past_the_visibility_timeout_runs_once_and_extended_is_not_redelivered(
        workers: WorkerPool, sqs: int) -> None:
    """Two 4 s bodies at once under a 2 s visibility timeout, two workers ``-c 2``. The plain
    task's message is handed to the other worker while the first still runs it: each copy
    finds the key held and is deferred (its message deleted); the body runs once under token 1.
    The task with ``lease_extend_visibility`` has its message's visibility extended while its
    lease is renewed: received once, never deferred. Once both are done the queue empties and
    nothing comes back."""
    workers.start("a", concurrency=2)
    workers.start("b", concurrency=2)
    plain, extended = _job(), _job()
    plain_id, extended_id = str(uuid.uuid4()), str(uuid.uuid4())
    results = [workers.client.send_task(WORK, args=(plain, 4.0), task_id=plain_id),
               workers.client.send_task(EXTENDED, args=(extended, 4.0), task_id=extended_id)]
    first = token_base(workers.store_url) + 1
    assert [r.get(timeout=40)["token"] for r in results] == [first, first]
    assert len(_received(workers, plain_id)) >= 2  # SQS redelivered it while it ran
    assert workers.journal.events("duplicate_deferred", key=f"job:{plain}")
    deadline = time.monotonic() + 30
    while not _queue_empty(workers, sqs):
        assert time.monotonic() < deadline, "the queue did not empty"
        time.sleep(0.5)
    time.sleep(2.5)  # past another visibility timeout: nothing comes back
    assert _queue_empty(workers, sqs)
    assert len(_received(workers, extended_id)) == 1
    assert workers.journal.events("duplicate_deferred", key=f"job:{extended}") == []
    for job in (plain, extended):
        assert len(workers.journal.events("body_start", job_id=job)) == 1
        with open_store(workers.store_url) as store:
            record = store.get(f"job:{job}")
            assert record is not None and (record.state, record.token) == (LeaseState.DONE,
                                                                           first)


@pytest.mark.worker_env(LEASE_TEST_TTL="2", LEASE_TEST_HEARTBEAT="0.5",
                        LEASE_TEST_VISIBILITY="3", LEASE_TEST_SWEEP_INTERVAL="0")
def test_a_sigkilled_worker_is_taken_over_by_the_sqs_redelivery(workers: WorkerPool) -> None:
    """Worker a is SIGKILLed mid-task. Its message was not deleted, so SQS hands it to worker b
    after the 3 s visibility timeout (the sweeper is off: the redelivery is SQS's own), which
    takes the expired lease over (token 2) and finishes: one accepted outcome, token 2."""
    job, task_id, result, first = _started_on_one_of_two(workers, 3.0)
    victim = next(w for w in workers.workers if first["pid"] in pool_children(w.process.pid))
    victim.kill()
    killed_at = time.time()
    base = token_base(workers.store_url)
    assert result.get(timeout=40)["token"] == base + 2
    starts = workers.journal.events("body_start", job_id=job)
    assert [s["token"] for s in starts] == [base + 1, base + 2]
    assert starts[1]["t"] - killed_at >= 1.0  # after the lease and the visibility ran out
    assert len(_received(workers, task_id)) == 2
    assert workers.journal.events("lease_swept") == []
    with open_store(workers.store_url) as store:
        record = store.get(f"job:{job}")
        assert record is not None and (record.state, record.token) == (LeaseState.DONE,
                                                                       base + 2)


@pytest.mark.worker_env(LEASE_TEST_TTL="4", LEASE_TEST_HEARTBEAT="0.5",
                        LEASE_TEST_VISIBILITY="2", LEASE_TEST_SETTLE_HOLD="3")
def test_an_sqs_redelivery_racing_the_settle_completes_the_task_once(
        workers: WorkerPool) -> None:
    """The accepted run is held 3 s between its finish and Celery's result write, longer than
    the 2 s visibility timeout: SQS hands the message to the worker's other pool process while
    the owner settles. The copy must not write the result nor send the callback again: one
    body run, one callback, one SUCCESS, the key done under token 1."""
    workers.start("a", concurrency=2)
    job, task_id = _job(), str(uuid.uuid4())
    link = workers.client.signature(CALLBACK, args=(job,))
    result = workers.client.send_task(QUICK, args=(job,), task_id=task_id, link=link)
    workers.journal.wait_for(lambda j: bool(j.events("settle_hold_over", task_id=task_id)),
                             timeout=30, what="the held settle to end")
    received = _received(workers, task_id)
    hold = workers.journal.events("settle_hold", task_id=task_id)[0]
    over = workers.journal.events("settle_hold_over", task_id=task_id)[0]
    assert any(hold["t"] < r["t"] < over["t"] for r in received[1:]), (
        "precondition: SQS redelivered the message while the owner settled", received)
    accepted = result.get(timeout=20)
    assert accepted["token"] == token_base(workers.store_url) + 1
    time.sleep(3.0)  # the deferred copy comes back and is dropped
    callbacks = workers.journal.events("callback", tag=job)
    assert len(callbacks) == 1, callbacks
    successes = [e for e in workers.journal.events("task_success") if e.get("task_id") == task_id]
    assert len(successes) == 1, successes
    assert len(workers.journal.events("body_start", job_id=job)) == 1


# -- lease_extend_visibility ------------------------------------------------------------------


@pytest.mark.worker_env(LEASE_TEST_TTL="2", LEASE_TEST_HEARTBEAT="0.5",
                        LEASE_TEST_VISIBILITY="2", LEASE_TEST_EXTEND_VISIBILITY="1",
                        LEASE_TEST_SWEEP_INTERVAL="0")
def test_a_stalled_owners_message_still_comes_back(workers: WorkerPool) -> None:
    """With the extension on, a pool process SIGSTOPped mid-task stops renewing its lease; the
    row expires, the extensions stop, and SQS hands the message to the other worker one
    visibility timeout later (the sweeper is off: this is SQS's redelivery), which takes the
    key over (token 2). The stalled owner, continued, finds its lease lost."""
    job, task_id, result, first = _started_on_one_of_two(workers, 4.0)
    os.kill(first["pid"], signal.SIGSTOP)
    try:
        base = token_base(workers.store_url)
        workers.journal.wait_for(lambda j: len(j.events("body_start", job_id=job)) > 1,
                                 timeout=30, what="SQS to redeliver the stalled task")
    finally:
        os.kill(first["pid"], signal.SIGCONT)
    assert result.get(timeout=30)["token"] == base + 2
    again = workers.journal.events("body_start", job_id=job)[1]
    assert again["token"] == base + 2 and again["t"] - first["t"] >= 2.0
    assert len(_received(workers, task_id)) == 2
    assert workers.journal.events("lease_swept") == []
    workers.journal.wait_for(
        lambda j: bool(j.events("body_lease_lost", job_id=job, token=base + 1)), timeout=15,
        what="the stalled owner to find its lease lost")
