"""The seams between the lease row and Celery's own lifecycle (DESIGN.md §6), with real workers.

Each scene runs real ``celery worker -P prefork`` subprocesses (tests/support/workers.py) on a Redis
broker queue of the test's own, and reads what happened from the journal the workers write
(tests/support/worker_app.py, section "settle"): body runs, link callbacks, and Celery's own
``task_received`` / ``task_success`` / ``task_failure`` / ``task_postrun`` per task id; from the
lease row; and from the result backend.

- a slow store (replies late: the chaos harness's DelayingProxy): a LeaseLost raised by the
  local deadline while the store still holds the lease must not end the work as a FAILURE
  with the row left ``ready`` and no message;
- a redelivery that arrives between the accepted finish and Celery's result write, while the
  first worker is alive, must not complete the task a second time;
- with ``rpc://`` (whose state reads PENDING inside a worker), duplicates of a finished task
  must not complete it again;
- time limits: the row and the result backend tell the same story.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest
from celery import Celery
from celery.result import AsyncResult

from benchmarks.chaos.proxy import DelayingProxy
from lease_celery import LeaseRecord, LeaseState, open_store
from tests.support.servers import REDIS_URL
from tests.support.tokens import token_base
from tests.support.workers import Journal, WorkerPool

pytestmark = pytest.mark.worker

UNTIL_LOST = "tests.support.worker_app.settle_until_lost"
QUICK = "tests.support.worker_app.settle_quick"
SOFT_LIMITED = "tests.support.worker_app.settle_soft_limited"
HARD_LIMITED = "tests.support.worker_app.settle_hard_limited"
CALLBACK = "tests.support.worker_app.callback"


def _job() -> str:
    return uuid.uuid4().hex[:10]


def _record(store_url: str, key: str) -> LeaseRecord | None:
    with open_store(store_url) as store:
        return store.get(key)


def _describe(record: LeaseRecord | None) -> str:
    if record is None:
        return "no row"
    return (f"state={record.state.value} token={record.token} attempts={record.attempts} "
            f"reason={record.reason!r} result={record.result!r}")


def _wait_for_state(store_url: str, key: str, state: LeaseState, *,
                    timeout: float) -> LeaseRecord | None:
    """Poll the row until it is in ``state``; return the last record seen either way."""
    deadline = time.monotonic() + timeout
    while True:
        record = _record(store_url, key)
        if (record is not None and record.state is state) or time.monotonic() > deadline:
            return record
        time.sleep(0.1)


def _of(journal: Journal, event: str, task_id: str) -> list[dict[str, Any]]:
    return journal.events(event, task_id=task_id)


def _wait_quiet(journal: Journal, task_id: str, *, deliveries: int, quiet: float = 2.0,
                timeout: float = 20.0) -> None:
    """Wait until every delivery of ``task_id`` a worker received has run (``task_postrun``
    for each ``task_received``, at least ``deliveries`` of them) and nothing new happened for
    ``quiet`` seconds: copies re-published for later (deferred) have come back and ended."""
    deadline = time.monotonic() + timeout
    last, since = None, time.monotonic()
    while True:
        received = len(_of(journal, "task_received", task_id))
        ran = len(_of(journal, "task_postrun", task_id))
        now = time.monotonic()
        if (received, ran) != last:
            last, since = (received, ran), now
        elif received >= deliveries and ran >= received and now - since >= quiet:
            return
        if now > deadline:
            raise AssertionError(
                f"deliveries of {task_id} did not settle within {timeout}s (received "
                f"{received}, ran {ran}); journal:\n" + "\n".join(map(str, journal.events())))
        time.sleep(0.1)


def _callbacks(journal: Journal, job: str) -> list[dict[str, Any]]:
    return journal.events("callback", tag=job)


def _successes(journal: Journal, task_id: str, task: str) -> list[dict[str, Any]]:
    return [e for e in _of(journal, "task_success", task_id) if e["task"] == task]


# -- 1. a slow store: LeaseLost from the local deadline ----------------------------------------


def _through(proxy: DelayingProxy, url: str) -> str:
    """``url`` with its host and port replaced by the proxy's."""
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, f"127.0.0.1:{proxy.port}", parts.path, parts.query, ""))


def _warm_up(store_url: str) -> None:
    """Run claim, renew and release once, so that the store's scripts / schema exist before
    the replies are slowed down (a Redis NOSCRIPT reply would cost one more slow round trip)."""
    with open_store(store_url) as store:
        lease = store.claim(f"warm-up:{uuid.uuid4().hex}", owner="warm-up", ttl=5)
        assert lease is not None
        assert store.renew(lease, ttl=5) is not None
        assert store.release(lease)


@pytest.fixture
def slow_store(workers: WorkerPool) -> Iterator[DelayingProxy]:
    """A delaying proxy in front of the workers' lease store (Redis or PostgreSQL); the
    workers reach the store through it, the test reads the store directly."""
    _warm_up(workers.store_url)
    parts = urlsplit(workers.store_url)
    proxy = DelayingProxy(parts.hostname or "127.0.0.1", parts.port or 0)
    try:
        workers.env["LEASE_TEST_STORE"] = _through(proxy, workers.store_url)
        yield proxy
        workers.stop_all()  # before the proxy goes: no store outage at shutdown
    finally:
        proxy.close()


@pytest.mark.parametrize("worker_store", ["redis", "postgres"], indirect=True)
@pytest.mark.worker_env(LEASE_TEST_TTL="2", LEASE_TEST_HEARTBEAT="0.5")
def test_lease_lost_to_a_slow_store_runs_the_task_again_instead_of_failing_it(
        workers: WorkerPool, slow_store: DelayingProxy) -> None:
    """The store's replies come back 1.2 × ttl late while the first generation runs: renewals
    still succeed on the store, but no reply arrives before its own local deadline (replies
    late by less than the ttl no longer lose the lease: renewals are pipelined), so
    ``self.lease.check()`` raises LeaseLost while the store still holds the lease. That loss
    must not lose the work: no FAILURE is recorded for it, the body runs again (once the store
    answers promptly again), the key ends ``done`` and ``AsyncResult.get()`` returns the
    accepted result."""
    ttl = 2.0
    workers.start("a", concurrency=2)
    job, task_id = _job(), str(uuid.uuid4())
    key = f"job:{job}"
    result = workers.client.send_task(UNTIL_LOST, args=(job,), task_id=task_id)
    first = token_base(workers.store_url) + 1
    workers.journal.wait_for(lambda j: bool(j.events("body_start", job_id=job, token=first)),
                             timeout=20, what="the first generation to start")
    slow_store.delay = 1.2 * ttl
    try:
        workers.journal.wait_for(lambda j: bool(j.events("body_lease_lost", job_id=job)),
                                 timeout=4 * ttl,
                                 what="precondition: check() raises LeaseLost (local deadline)")
    finally:
        slow_store.delay = 0.0
    lost = workers.journal.events("body_lease_lost", job_id=job)[0]

    record = _wait_for_state(workers.store_url, key, LeaseState.DONE, timeout=15)
    failures = _of(workers.journal, "task_failure", task_id)
    assert record is not None and record.state is LeaseState.DONE, (
        f"the key never ended done after the local LeaseLost: {_describe(record)}; "
        f"Celery recorded: {[f['exception'] for f in failures]}")
    assert failures == [], f"a FAILURE was recorded for the lost lease: {failures}"
    starts = workers.journal.events("body_start", job_id=job)
    assert len(starts) >= 2 and starts[-1]["t"] > lost["t"], (
        f"the body did not run again after the loss: {starts}")
    assert AsyncResult(task_id, app=workers.client).get(timeout=10) == record.result
    assert record.result == {"job_id": job, "token": record.token,
                             "owner": starts[-1]["owner"]}
    assert result.state == "SUCCESS"
    assert _of(workers.journal, "task_failure", task_id) == []


# -- 2. a redelivery between the accepted finish and Celery's result write ------------------


@pytest.mark.worker_env(LEASE_TEST_TTL="3", LEASE_TEST_HEARTBEAT="0.5",
                        LEASE_TEST_SETTLE_HOLD="0.8")
def test_redelivery_between_finish_and_result_write_does_not_complete_the_task_again(
        workers: WorkerPool) -> None:
    """The accepted run has finished its lease and is held (a lease_finished receiver sleeps
    0.8 s, well within the ttl of 3 s) before Celery writes its result and sends its callbacks;
    meanwhile the same task id (same args, same link) is delivered again to the worker's other
    pool process. The first worker is alive and completes the task: the duplicate must not
    write the result again nor send the link callback again. One body run, one callback, one
    SUCCESS: the accepted one."""
    workers.start("a", concurrency=2)
    job, task_id = _job(), str(uuid.uuid4())
    link = workers.client.signature(CALLBACK, args=(job,))
    result = workers.client.send_task(QUICK, args=(job,), task_id=task_id, link=link)
    workers.journal.wait_for(lambda j: bool(_of(j, "settle_hold", task_id)), timeout=20,
                             what="the accepted run to be held after its finish")
    workers.client.send_task(QUICK, args=(job,), task_id=task_id, link=link)
    workers.journal.wait_for(lambda j: len(_of(j, "task_received", task_id)) >= 2, timeout=5,
                             what="the duplicate to be received")
    workers.journal.wait_for(lambda j: bool(_of(j, "settle_hold_over", task_id)), timeout=10,
                             what="the hold to end")
    received = _of(workers.journal, "task_received", task_id)
    hold_over = _of(workers.journal, "settle_hold_over", task_id)[0]
    assert received[1]["t"] < hold_over["t"], "precondition: the duplicate came in the window"
    starts = workers.journal.events("body_start", job_id=job)
    accepted = {"job_id": job, "token": 1, "owner": starts[0]["owner"]}
    assert result.get(timeout=15) == accepted
    _wait_quiet(workers.journal, task_id, deliveries=2)

    callbacks = _callbacks(workers.journal, job)
    assert len(callbacks) == 1, f"the link callback ran {len(callbacks)} times: {callbacks}"
    assert callbacks[0]["result"] == accepted
    successes = _successes(workers.journal, task_id, QUICK)
    assert len(successes) == 1, f"the result was written {len(successes)} times: {successes}"
    assert len(workers.journal.events("body_start", job_id=job)) == 1
    assert AsyncResult(task_id, app=workers.client).get(timeout=5) == accepted
    record = _record(workers.store_url, f"job:{job}")
    assert record is not None and (record.state, record.token) == (LeaseState.DONE, 1)
    assert record.result == accepted


# -- 3. rpc:// answers PENDING inside a worker ----------------------------------------------


@pytest.fixture
def rpc_client(workers: WorkerPool) -> Iterator[Celery]:
    """A client app on the workers' queue whose result backend is ``rpc://``."""
    app = Celery("lease-tests-rpc-client", broker=REDIS_URL, backend="rpc://")
    app.conf.task_default_queue = workers.env["LEASE_TEST_QUEUE"]
    yield app
    app.close()


@pytest.mark.worker_env(LEASE_TEST_TTL="1.5", LEASE_TEST_HEARTBEAT="0.4",
                        LEASE_TEST_RESULT_BACKEND="rpc://")
def test_rpc_backend_duplicates_of_a_finished_task_do_not_run_its_callback_again(
        workers: WorkerPool, rpc_client: Celery) -> None:
    """With ``result_backend='rpc://'`` (Celery's RabbitMQ tutorial setup; here on the Redis
    broker) a task with a ``link`` callback finishes, then the same task id is published four
    more times. rpc:// cannot tell a worker whether a task finished (its state reads PENDING
    there), so it must not be asked: the duplicates are dropped. The body ran once, the link
    callback ran once and one SUCCESS was sent."""
    workers.start("a", concurrency=2)
    job, task_id = _job(), str(uuid.uuid4())
    link = rpc_client.signature(CALLBACK, args=(job,))
    result = rpc_client.send_task(QUICK, args=(job,), task_id=task_id, link=link)
    first = result.get(timeout=20)
    workers.journal.wait_for(lambda j: bool(_callbacks(j, job)), timeout=15,
                             what="the first callback")
    _wait_quiet(workers.journal, task_id, deliveries=1, quiet=0.5)
    for _ in range(4):
        rpc_client.send_task(QUICK, args=(job,), task_id=task_id, link=link)
    _wait_quiet(workers.journal, task_id, deliveries=5)

    callbacks = _callbacks(workers.journal, job)
    assert len(callbacks) == 1, f"the link callback ran {len(callbacks)} times: {callbacks}"
    successes = _successes(workers.journal, task_id, QUICK)
    assert len(successes) == 1, f"the result was sent {len(successes)} times: {successes}"
    starts = workers.journal.events("body_start", job_id=job)
    assert len(starts) == 1
    assert first == {"job_id": job, "token": 1, "owner": starts[0]["owner"]}
    record = _record(workers.store_url, f"job:{job}")
    assert record is not None and (record.state, record.token) == (LeaseState.DONE, 1)
    assert record.result == first


# -- 4. time limits: the row and the result backend agree ----------------------------------


@pytest.mark.worker_env(LEASE_TEST_TTL="2", LEASE_TEST_HEARTBEAT="0.5",
                        LEASE_TEST_BACKOFF_BASE="0.2", LEASE_TEST_BACKOFF_MAX="0.5")
def test_soft_time_limit_fails_the_task_once_and_the_key_goes_dead(
        workers: WorkerPool) -> None:
    """A LeasedTask with ``soft_time_limit=1`` whose body sleeps 3 s: Celery raises
    SoftTimeLimitExceeded in the body and the task FAILS. The lease row says the same: the key
    is ``dead`` with a reason naming the soft time limit after ONE body run (not retried as a
    transient error until its attempts run out)."""
    workers.start("a", concurrency=2)
    job, task_id = _job(), str(uuid.uuid4())
    result = workers.client.send_task(SOFT_LIMITED, args=(job,), task_id=task_id)
    result.get(timeout=25, propagate=False)
    _wait_quiet(workers.journal, task_id, deliveries=1, quiet=1.5)

    starts = workers.journal.events("body_start", job_id=job)
    assert len(starts) == 1, f"the body ran {len(starts)} times: {starts}"
    state = AsyncResult(task_id, app=workers.client)
    assert state.state == "FAILURE"
    record = _record(workers.store_url, f"job:{job}")
    assert record is not None and record.state is LeaseState.DEAD, _describe(record)
    reason = record.reason or ""
    assert "soft time limit" in reason.lower() or "SoftTimeLimitExceeded" in reason, reason
    assert not workers.journal.events("body_end", job_id=job)


@pytest.mark.worker_env(LEASE_TEST_TTL="1", LEASE_TEST_HEARTBEAT="0.25")
def test_hard_time_limit_fails_the_task_and_the_key_stays_dead(workers: WorkerPool) -> None:
    """A LeasedTask with ``time_limit=1`` (hard) whose body sleeps 3 s: the pool kills the
    process running it and Celery records FAILURE (TimeLimitExceeded). The lease row says the
    same: the key is ``dead`` with a reason naming the time limit, not ``ready`` (which a
    sweeper would run again, or nothing would ever run), and the body does not run again over
    the next few ttls."""
    workers.start("a", concurrency=2)
    job, task_id = _job(), str(uuid.uuid4())
    key = f"job:{job}"
    result = workers.client.send_task(HARD_LIMITED, args=(job,), task_id=task_id)
    result.get(timeout=20, propagate=False)
    assert result.state == "FAILURE"
    assert "TimeLimitExceeded" in repr(result.result)

    record = _wait_for_state(workers.store_url, key, LeaseState.DEAD, timeout=5)
    assert record is not None and record.state is LeaseState.DEAD, (
        f"the result backend says FAILURE (TimeLimitExceeded), the row: {_describe(record)}")
    reason = record.reason or ""
    assert "time limit" in reason.lower() or "TimeLimitExceeded" in reason, reason
    # The verdict is the completion's, as for any death: its signal, once (from the worker's
    # main process), and the failure a duplicate is answered with.
    assert [e["key"] for e in workers.journal.events("lease_dead", key=key)] == [key]
    assert isinstance(record.result, dict) and record.result["exc_type"] == "TimeLimitExceeded"
    time.sleep(3.0)  # a few ttls: a sweeper or a redelivery would run it again now
    assert len(workers.journal.events("body_start", job_id=job)) == 1
    record = _record(workers.store_url, key)
    assert record is not None and record.state is LeaseState.DEAD, _describe(record)
    assert AsyncResult(task_id, app=workers.client).state == "FAILURE"


@pytest.mark.worker_env(LEASE_TEST_TTL="2", LEASE_TEST_HEARTBEAT="0.5",
                        LEASE_TEST_BACKOFF_BASE="0.2", LEASE_TEST_BACKOFF_MAX="0.5")
@pytest.mark.parametrize("limit", ["soft", "hard"])
def test_time_limits_are_retried_when_the_task_opts_in(workers: WorkerPool, limit: str) -> None:
    """``lease_retry_time_limits=True``: a soft limit is retried by the policy (released with a
    backoff), a hard one is released and re-published by the worker's main process; the
    second generation succeeds, and the backend ends with its SUCCESS."""
    workers.start("a", concurrency=2)
    job, task_id = _job(), str(uuid.uuid4())
    name = f"tests.support.worker_app.{limit}_limited_retried"
    workers.client.send_task(name, args=(job,), task_id=task_id)
    record = _wait_for_state(workers.store_url, f"job:{job}", LeaseState.DONE, timeout=25)
    assert record is not None and record.state is LeaseState.DONE, _describe(record)
    assert record.token == 2 and record.result == {"job_id": job, "token": 2}
    deadline = time.monotonic() + 10
    result = AsyncResult(task_id, app=workers.client)
    while result.state != "SUCCESS" and time.monotonic() < deadline:
        time.sleep(0.1)
    assert result.state == "SUCCESS" and result.result == record.result
    assert [s["token"] for s in workers.journal.events("body_start", job_id=job)] == [1, 2]
