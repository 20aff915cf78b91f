"""The failure policy with real workers: attempts and backoff, dead letters, takeovers, Celery's
own retries, requeue through the CLI, the sweeper, and giving leases back at shutdown.

Real ``celery worker`` subprocesses (prefork, ``task_acks_late``, ``task_reject_on_worker_lost``)
on a Redis broker of the test's own queue; what happened is read from the journal the workers
write (tests/support/worker_app.py), from the result backend and from the lease row itself.
"""

from __future__ import annotations

import itertools
import os
import signal
import time
import uuid
from pathlib import Path

import pytest
from celery.result import AsyncResult

from lease_celery import LeaseState
from tests.support.policy_helpers import (
    cli_env,
    free_port,
    get_record,
    parse_json,
    run_cli,
    scrape,
    wait_until,
)
from tests.support.workers import WorkerPool

pytestmark = pytest.mark.worker

WORK = "tests.support.worker_app.work"
ALWAYS_FAILS = "tests.support.worker_app.always_fails"


def _job() -> str:
    return uuid.uuid4().hex[:10]


def _fresh_state(workers: WorkerPool, task_id: str) -> AsyncResult:
    """A new AsyncResult each time: a ready one caches its first state forever."""
    return AsyncResult(task_id, app=workers.client)


@pytest.mark.worker_env(LEASE_TEST_TTL="2", LEASE_TEST_HEARTBEAT="0.5",
                        LEASE_TEST_MAX_ATTEMPTS="4", LEASE_TEST_BACKOFF_BASE="0.3",
                        LEASE_TEST_BACKOFF_MAX="2", LEASE_TEST_RETRY_ERRORS="1")
def test_transient_error_goes_dead_after_max_attempts_with_growing_backoff(
        workers: WorkerPool) -> None:
    """With the opt-in error retries (``lease_retry_errors``; by default an error fails the
    task at once, as in Celery: tests/workers/test_celery_semantics.py), a task that always
    raises a transient error runs lease_max_attempts (4) times, each
    retry after a backoff of at least base·2^(n-1)/2 that grows from one attempt to the next and
    never before the row's not_before; then the key is dead ("4 attempts exhausted") and the
    result backend holds FAILURE. A permanent error (``permanent_errors=(ValueError,)``) goes
    dead on its first attempt, with no retry."""
    workers.start("a", concurrency=2)
    job, permanent = _job(), _job()
    result = workers.client.send_task(ALWAYS_FAILS, args=(job, "transient"))
    dead_at_once = workers.client.send_task(ALWAYS_FAILS, args=(permanent, "permanent"))

    assert isinstance(result.get(timeout=30, propagate=False), RuntimeError)
    assert result.state == "FAILURE"
    assert "transient failure" in str(result.result)
    starts = workers.journal.events("body_start", job_id=job)
    assert [(s["token"], s["attempts"]) for s in starts] == [(1, 1), (2, 2), (3, 3), (4, 4)]
    retries = workers.journal.events("lease_retry", key=f"job:{job}")
    assert [r["token"] for r in retries] == [1, 2, 3]
    base, cap = 0.3, 2.0
    gaps = [later["t"] - earlier["t"] for earlier, later in itertools.pairwise(starts)]
    for n, (gap, retry, start) in enumerate(zip(gaps, retries, starts[1:], strict=True),
                                             start=1):
        ceiling = min(cap, base * 2 ** (n - 1))
        assert ceiling / 2 <= retry["countdown"] <= ceiling  # the policy's equal jitter
        assert gap >= ceiling / 2, f"attempt {n + 1} came {gap:.3f}s after attempt {n}"
        assert gap >= retry["countdown"] - 0.02
        # The row's backoff held: the next attempt started only once not_before had passed.
        assert retry["not_before"] is not None and start["t"] >= retry["not_before"]
    countdowns = [r["countdown"] for r in retries]
    assert countdowns == sorted(countdowns)
    assert gaps[-1] > gaps[0]
    record = get_record(workers.store_url, f"job:{job}")
    assert record is not None
    assert (record.state, record.token, record.attempts) == (LeaseState.DEAD, 4, 4)
    assert "4 attempts exhausted" in (record.reason or "")
    assert "RuntimeError" in (record.reason or "")
    assert workers.journal.events("lease_dead", key=f"job:{job}", token=4)

    assert isinstance(dead_at_once.get(timeout=30, propagate=False), ValueError)
    assert dead_at_once.state == "FAILURE"
    assert len(workers.journal.events("body_start", job_id=permanent)) == 1
    assert not workers.journal.events("lease_retry", key=f"job:{permanent}")
    record = get_record(workers.store_url, f"job:{permanent}")
    assert record is not None
    assert (record.state, record.token, record.attempts) == (LeaseState.DEAD, 1, 1)
    assert (record.reason or "").startswith("permanent error: ValueError")


@pytest.mark.worker_env(LEASE_TEST_TTL="2", LEASE_TEST_HEARTBEAT="0.5",
                        LEASE_TEST_MAX_ATTEMPTS="10", LEASE_TEST_BACKOFF_BASE="0.05",
                        LEASE_TEST_BACKOFF_MAX="0.1")
def test_celery_retry_and_autoretry_agree_with_the_lease_row(workers: WorkerPool) -> None:
    """Celery's own retries keep working under the lease, as Celery's control flow: each is a
    new claim (a new token) that gives its attempt back, so the row counts the one attempt
    Celery's retries make of the task: ``self.retry()`` twice then success → 3 body runs, row
    done with token 3 and attempts 1; ``autoretry_for`` with max_retries=2 → 3 body runs,
    FAILURE, row dead with token 3 and attempts 1, and the lease adds no retry of its own on
    top (no lease_retry, no fourth run). (The row used to count every run as an attempt, so
    ``lease_max_attempts`` cut Celery's retries off.)"""
    workers.start("a", concurrency=2)
    retried, auto = _job(), _job()
    flaky = workers.client.send_task("tests.support.worker_app.flaky", args=(retried, 2))
    autoretried = workers.client.send_task("tests.support.worker_app.autoretried", args=(auto,))

    assert flaky.get(timeout=30) == {"job_id": retried, "token": 3, "retries": 2}
    runs = workers.journal.events("body_start", job_id=retried)
    record = get_record(workers.store_url, f"job:{retried}")
    assert record is not None
    assert len(runs) == 3
    assert (record.state, record.token, record.attempts) == (LeaseState.DONE, 3, 1)

    assert isinstance(autoretried.get(timeout=30, propagate=False), RuntimeError)
    assert autoretried.state == "FAILURE"
    time.sleep(1.0)  # a retry the lease added would run now
    runs = workers.journal.events("body_start", job_id=auto)
    assert [r["retries"] for r in runs] == [0, 1, 2]
    assert not workers.journal.events("lease_retry", key=f"job:{auto}")
    record = get_record(workers.store_url, f"job:{auto}")
    assert record is not None
    assert (record.state, record.token, record.attempts) == (LeaseState.DEAD, 3, 1)
    assert "RuntimeError" in (record.reason or "")


@pytest.mark.worker_env(LEASE_TEST_TTL="2", LEASE_TEST_HEARTBEAT="0.5",
                        LEASE_TEST_MAX_ATTEMPTS="6", LEASE_TEST_BACKOFF_BASE="0.05",
                        LEASE_TEST_BACKOFF_MAX="0.1")
def test_celery_max_retries_is_not_extended_by_the_lease_policy(workers: WorkerPool) -> None:
    """A task that calls ``self.retry(exc=...)`` with max_retries=3 runs 4 times (Celery then
    raises the error itself) even though lease_max_attempts is 6: FAILURE, and the row is dead
    with its token at 4 (one claim per run) and one attempt (Celery's retries give theirs
    back)."""
    workers.start("a", concurrency=1)
    job = _job()
    result = workers.client.send_task("tests.support.worker_app.flaky", args=(job, 100))
    assert isinstance(result.get(timeout=30, propagate=False), RuntimeError)
    time.sleep(0.5)
    runs = workers.journal.events("body_start", job_id=job)
    record = get_record(workers.store_url, f"job:{job}")
    assert record is not None
    assert [r["retries"] for r in runs] == [0, 1, 2, 3]
    assert (record.state, record.token, record.attempts) == (LeaseState.DEAD, 4, 1)


@pytest.mark.worker_env(LEASE_TEST_TTL="2", LEASE_TEST_HEARTBEAT="0.5",
                        LEASE_TEST_MAX_ATTEMPTS="6", LEASE_TEST_BACKOFF_BASE="0.05",
                        LEASE_TEST_BACKOFF_MAX="0.1", LEASE_TEST_RETRY_ERRORS="1")
def test_lease_max_attempts_above_celerys_default_max_retries(workers: WorkerPool) -> None:
    """With ``lease_retry_errors``, lease_max_attempts=6 on a task that keeps Celery's default
    max_retries (3) and never
    calls self.retry() itself: the policy's retries are the lease's, so the body runs 6 times
    and the key ends dead ("6 attempts exhausted") with FAILURE in the result backend."""
    workers.start("a", concurrency=1)
    job = _job()
    result = workers.client.send_task(ALWAYS_FAILS, args=(job, "transient"))
    assert isinstance(result.get(timeout=30, propagate=False), RuntimeError)
    time.sleep(0.5)
    runs = workers.journal.events("body_start", job_id=job)
    record = get_record(workers.store_url, f"job:{job}")
    assert record is not None
    assert [r["attempts"] for r in runs] == [1, 2, 3, 4, 5, 6]
    assert (record.state, record.attempts) == (LeaseState.DEAD, 6)
    assert "6 attempts exhausted" in (record.reason or "")


@pytest.mark.worker_env(LEASE_TEST_TTL="2", LEASE_TEST_HEARTBEAT="0.5",
                        LEASE_TEST_MAX_ATTEMPTS="3", LEASE_TEST_RETRY_ERRORS="1")
def test_lease_max_attempts_does_not_cap_celery_retries_even_with_error_retries_on(
        workers: WorkerPool) -> None:
    """``self.retry()`` with max_retries=3 under lease_max_attempts=3 and the opt-in error
    retries: the body runs 4 times, as Celery's max_retries says (this test used to assert 3
    runs: the lease's cap cut Celery's retries off, which Celery's own ``test_retry`` caught);
    the error Celery raises once its retries are spent is final (no lease retry on top), and
    the key ends dead with FAILURE and one attempt."""
    workers.start("a", concurrency=1)
    job = _job()
    result = workers.client.send_task("tests.support.worker_app.flaky", args=(job, 100))
    result.get(timeout=30, propagate=False)
    assert result.state == "FAILURE"
    time.sleep(0.5)  # a lease retry would run now
    runs = workers.journal.events("body_start", job_id=job)
    record = get_record(workers.store_url, f"job:{job}")
    assert record is not None and record.state is LeaseState.DEAD
    assert [r["retries"] for r in runs] == [0, 1, 2, 3]
    assert record.attempts == 1
    assert not workers.journal.events("lease_retry", key=f"job:{job}")


@pytest.mark.worker_env(LEASE_TEST_TTL="1", LEASE_TEST_HEARTBEAT="0.25",
                        LEASE_TEST_MAX_TAKEOVERS="2", LEASE_TEST_MAX_ATTEMPTS="10")
def test_worker_killed_on_every_attempt_goes_dead_after_max_takeovers(
        workers: WorkerPool) -> None:
    """A task whose whole worker is SIGKILLed in every generation (the body kills its own
    process group) is taken over by the next worker each time (its sweeper re-publishes the
    expired lease; the broker's visibility timeout is the default hour); the claim after the
    second takeover exceeds lease_max_takeovers=2, so the key goes dead without running the
    body: FAILURE (LeaseDead) in the result backend and a reason about the lost workers."""
    job = _job()
    result = None
    for generation in range(1, 5):
        worker = workers.start(f"w{generation}", concurrency=1)
        if result is None:
            result = workers.client.send_task("tests.support.worker_app.kills_its_worker",
                                              args=(job,))
        if generation == 4:
            break
        workers.journal.wait_for(
            lambda j, n=generation: len(j.events("body_start", job_id=job)) == n,
            timeout=20, what=f"generation {generation} to start")
        worker.process.wait(10)  # the body killed it
    assert result is not None
    failure = result.get(timeout=30, propagate=False)
    assert result.state == "FAILURE"
    assert type(failure).__name__ == "LeaseDead"
    starts = workers.journal.events("body_start", job_id=job)
    assert [(s["token"], s["takeovers"]) for s in starts] == [(1, 0), (2, 1), (3, 2)]
    assert len({s["pid"] for s in starts}) == 3
    record = get_record(workers.store_url, f"job:{job}")
    assert record is not None
    assert (record.state, record.token, record.takeovers) == (LeaseState.DEAD, 4, 3)
    assert "lease_max_takeovers=2" in (record.reason or "")
    assert workers.journal.events("lease_dead", key=f"job:{job}", token=4)
    assert len(workers.journal.events("lease_swept", key=f"job:{job}")) == 3


@pytest.mark.worker_env(LEASE_TEST_TTL="2", LEASE_TEST_HEARTBEAT="0.5")
def test_cli_requeue_brings_a_dead_task_back_and_it_completes(
        workers: WorkerPool, tmp_path: Path) -> None:
    """A task that failed permanently is dead;
    ``celery -A tests.support.worker_app leases requeue KEY``
    (a real subprocess) makes the key ready again and re-publishes the recorded task (same task
    id), which completes on a worker under the next token; the result backend then holds
    SUCCESS. Requeueing a key that is no longer dead exits 1."""
    workers.start("a", concurrency=1)
    job, task_id = _job(), str(uuid.uuid4())
    workers.journal.client.set(f"{workers.env['LEASE_TEST_JOURNAL']}:fail:{job}", 1)
    failed = workers.client.send_task("tests.support.worker_app.toggled", args=(job,),
                                      task_id=task_id)
    assert isinstance(failed.get(timeout=30, propagate=False), ValueError)
    record = get_record(workers.store_url, f"job:{job}")
    assert record is not None and (record.state, record.token) == (LeaseState.DEAD, 1)

    workers.journal.client.delete(f"{workers.env['LEASE_TEST_JOURNAL']}:fail:{job}")
    env = cli_env(workers.store_url, {"LEASE_TEST_QUEUE": workers.env["LEASE_TEST_QUEUE"],
                                      "LEASE_TEST_JOURNAL": workers.env["LEASE_TEST_JOURNAL"]})
    proc = run_cli(["--json", "requeue", f"job:{job}"], env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert parse_json(proc) == {"requeued": f"job:{job}", "task_id": task_id}

    workers.journal.wait_for(lambda j: bool(j.events("body_end", job_id=job, token=2)),
                             timeout=30, what="the requeued task to complete")
    wait_until(lambda: _fresh_state(workers, task_id).state == "SUCCESS", timeout=10,
               what="SUCCESS in the result backend")
    assert _fresh_state(workers, task_id).result == {"job_id": job, "token": 2}
    record = get_record(workers.store_url, f"job:{job}")
    assert record is not None
    assert (record.state, record.token, record.attempts) == (LeaseState.DONE, 2, 1)

    again = run_cli(["requeue", f"job:{job}"], env=env, cwd=tmp_path)
    assert again.returncode == 1
    assert "is done: only a dead lease can be requeued" in again.stderr


@pytest.mark.worker_env(LEASE_TEST_TTL="1.5", LEASE_TEST_HEARTBEAT="0.4")
def test_sweeper_recovers_a_killed_worker_task_under_the_default_visibility_timeout(
        workers: WorkerPool, tmp_path: Path) -> None:
    """The whole worker running a task is SIGKILLed while the broker's visibility timeout is
    the default hour: a second worker's sweeper sees the lease expire, re-publishes the task,
    and it completes under token 2 within a few ttls (not an hour); lease_swept fires once
    (journal and the Prometheus counter lease_celery_swept_total)."""
    ttl = 1.5
    doomed = workers.start("doomed", concurrency=1)
    job, task_id = _job(), str(uuid.uuid4())
    result = workers.client.send_task(WORK, args=(job, 1.0), task_id=task_id)
    workers.journal.wait_for(lambda j: bool(j.events("body_start", job_id=job)), timeout=20,
                             what="the doomed worker to start the task")
    doomed.kill()
    killed_at = time.monotonic()
    prometheus_dir = tmp_path / "prometheus"
    prometheus_dir.mkdir()
    port = free_port()
    workers.start("survivor", concurrency=1,
                  extra_env={"PROMETHEUS_MULTIPROC_DIR": str(prometheus_dir),
                             "LEASE_TEST_METRICS_PORT": str(port)})
    started_in = time.monotonic() - killed_at

    assert result.get(timeout=30)["token"] == 2
    elapsed = time.monotonic() - killed_at
    assert elapsed < 5 * ttl + started_in, f"recovered after {elapsed:.1f}s"
    starts = workers.journal.events("body_start", job_id=job)
    assert [s["token"] for s in starts] == [1, 2]
    # Not before the dead owner's lease expired (claimed a few ms before its body started).
    assert starts[1]["t"] >= starts[0]["t"] + ttl - 0.1
    assert len(workers.journal.events("lease_swept", key=f"job:{job}")) == 1
    assert workers.journal.events("lease_taken_over", key=f"job:{job}", token=2)
    assert scrape(port).get("lease_celery_swept_total", 0) >= 1
    record = get_record(workers.store_url, f"job:{job}")
    assert record is not None
    assert (record.state, record.token, record.takeovers) == (LeaseState.DONE, 2, 1)


def _shutdown_scene(workers: WorkerPool, soft_timeout: float | None) -> dict[str, float]:
    """Worker A runs a task (ttl 10 s); an idle worker B waits; A gets SIGQUIT (cold shutdown,
    after ``soft_timeout`` of soft shutdown). Returns timings and the row's states."""
    extra = {} if soft_timeout is None else {"LEASE_TEST_SOFT_SHUTDOWN": str(soft_timeout)}
    # The successor starts first, on a queue nothing is sent to, and joins the task's queue
    # once A runs the task: started after, it took longer than the 3 s body under load (the
    # row was done before A got the signal).
    queue = workers.env["LEASE_TEST_QUEUE"]
    successor = workers.start("successor", concurrency=1, queue=f"{queue}.idle")
    first = workers.start("first", concurrency=1, extra_env=extra)
    job = _job()
    result = workers.client.send_task(WORK, args=(job, 3.0))
    workers.journal.wait_for(lambda j: bool(j.events("body_start", job_id=job)), timeout=20,
                             what="the first worker to start the task")
    hostname = f"{successor.name}@{os.uname().nodename}"
    replies = workers.client.control.add_consumer(queue, destination=[hostname], reply=True,
                                                  timeout=5)
    assert replies, f"{hostname} did not answer add_consumer"
    before = get_record(workers.store_url, f"job:{job}")
    assert before is not None and before.state is LeaseState.RUNNING
    os.kill(first.process.pid, signal.SIGQUIT)
    signalled_at = time.time()
    ready = wait_until(
        lambda: (r := get_record(workers.store_url, f"job:{job}")) is not None
        and r.state is not LeaseState.RUNNING and r,
        timeout=10, what="the row to leave running")
    released_in = time.time() - signalled_at
    workers.journal.wait_for(lambda j: bool(j.events("body_start", job_id=job, token=2)),
                             timeout=20, what="the successor to claim the task")
    second_start = workers.journal.events("body_start", job_id=job, token=2)[0]["t"]
    assert result.get(timeout=20)["token"] == 2
    first.process.wait(10)
    return {"released_in": released_in, "state": ready.state, "token": ready.token,
            "reason": ready.reason, "second_start": second_start,
            "old_expires_at": before.expires_at, "signalled_at": signalled_at}


@pytest.mark.parametrize("soft_timeout", [None, 1.0], ids=["cold", "soft-then-cold"])
@pytest.mark.worker_env(LEASE_TEST_TTL="10", LEASE_TEST_HEARTBEAT="2")
def test_cold_shutdown_releases_the_lease_for_an_immediate_successor(
        workers: WorkerPool, soft_timeout: float | None) -> None:
    """SIGQUIT (cold shutdown; or soft shutdown for 1 s, then cold) terminates the pool child
    running a task: its lease becomes ready at once (token kept) instead of staying running
    until it expires, and a waiting worker claims the restored message under token 2 long
    before the old lease's expires_at. (Mechanism: billiard's SIGTERM handler raises
    SystemExit in the child, which unwinds the body through LeasedTask.__call__, whose error
    path releases the key; kombu restores the unacked message at shutdown.)"""
    scene = _shutdown_scene(workers, soft_timeout)
    assert (scene["state"], scene["token"]) == (LeaseState.READY, 1)
    assert scene["released_in"] < (soft_timeout or 0) + 1.5
    # The old lease would have run until at least now + ttl - heartbeat: the successor was
    # well ahead of it.
    assert scene["second_start"] < scene["old_expires_at"] - 4
    assert scene["second_start"] - scene["signalled_at"] < (soft_timeout or 0) + 4


@pytest.mark.worker_env(LEASE_TEST_TTL="10", LEASE_TEST_HEARTBEAT="2")
def test_cold_shutdown_release_reason_mentions_the_shutdown(workers: WorkerPool) -> None:
    """The reason recorded when a cold shutdown gives a lease back says it was a shutdown."""
    scene = _shutdown_scene(workers, None)
    assert scene["state"] is LeaseState.READY
    assert "shutdown" in (scene["reason"] or "")
