"""A duplicate under another task id gets its own answer (lease_celery.execution.answers), with real
workers, a Redis broker and result backend: its ``AsyncResult`` returns the accepted result,
a chord whose header member is delivered under two ids completes once, and a redelivery of an
answered duplicate answers nothing twice."""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest
from celery import chord
from celery.result import AsyncResult

from lease_celery import open_store
from lease_celery.execution.answers import answer_key
from lease_celery.models import LeaseState
from tests.support.workers import WorkerPool

WORK = "tests.support.worker_app.work"


def _job() -> str:
    return uuid.uuid4().hex[:10]


def _starts(workers: WorkerPool, job: str) -> list[dict[str, Any]]:
    return workers.journal.events("body_start", job_id=job)


@pytest.mark.worker_env(LEASE_TEST_TTL="2", LEASE_TEST_HEARTBEAT="0.5")
def test_a_duplicate_under_another_id_gets_the_holders_result_once_it_finishes(
        workers: WorkerPool) -> None:
    """The key is running under task A when the same work arrives under task B: B waits
    (deferred) and, once A finished, ``AsyncResult(B).get()`` returns A's accepted result;
    the body ran once, and B's own link callback ran once, with that result."""
    workers.start("a", concurrency=2)
    job = _job()
    first = workers.client.send_task(WORK, args=(job, 3.0), task_id=f"A-{job}")
    workers.journal.wait_for(lambda j: bool(j.events("body_start", job_id=job)), timeout=20,
                             what="A to start")
    link = workers.client.signature("tests.support.worker_app.callback", kwargs={"tag": f"B-{job}"})
    second = workers.client.send_task(WORK, args=(job, 3.0), task_id=f"B-{job}", link=link)
    accepted = first.get(timeout=30)
    assert second.get(timeout=30) == accepted
    assert len(_starts(workers, job)) == 1
    workers.journal.wait_for(lambda j: bool(j.events("callback", tag=f"B-{job}")),
                             timeout=10, what="B's callback")
    time.sleep(1.0)  # a second run of the callback would land within this
    assert [c["result"] for c in workers.journal.events("callback", tag=f"B-{job}")] == [
        accepted]
    with open_store(workers.store_url) as store:
        answer = store.get(answer_key(f"job:{job}", f"B-{job}"))
        record = store.get(f"job:{job}")
    assert record is not None and record.task_id == f"A-{job}" and record.token == 1
    assert answer is not None and answer.state is LeaseState.DONE
    assert answer.result == accepted and answer.task_id == f"B-{job}"


@pytest.mark.worker_env(LEASE_TEST_TTL="2", LEASE_TEST_HEARTBEAT="0.5")
def test_a_chord_whose_member_is_delivered_under_two_ids_completes_once(
        workers: WorkerPool) -> None:
    """One of a chord's 10 header members is also published on its own, under another id,
    first. The member's own delivery is answered with that run's result, so the chord
    completes once, its callback gets each of the 10 accepted results once, and each body
    ran once."""
    workers.start("a", concurrency=2)
    jobs = [_job() for _ in range(10)]
    alone = workers.client.send_task(WORK, args=(jobs[3], 1.0), task_id=f"alone-{jobs[3]}")
    workers.journal.wait_for(lambda j: bool(j.events("body_start", job_id=jobs[3])),
                             timeout=20, what="the lone publish to start")
    tag = f"chord-{jobs[0]}"
    header = [workers.client.signature(WORK, args=(job, 0.2)) for job in jobs]
    body = workers.client.signature("tests.support.worker_app.callback", kwargs={"tag": tag})
    chord(header)(body)
    workers.journal.wait_for(lambda j: bool(j.events("callback", tag=tag)), timeout=40,
                             what="the chord callback")
    time.sleep(1.5)  # a second completion of the chord would land within this
    calls = workers.journal.events("callback", tag=tag)
    assert len(calls) == 1, calls
    results = calls[0]["result"]
    assert sorted(r["job_id"] for r in results) == sorted(jobs)
    assert all(r["token"] == 1 for r in results)
    lone = alone.get(timeout=10)
    assert [r for r in results if r["job_id"] == jobs[3]] == [lone]
    for job in jobs:
        assert len(_starts(workers, job)) == 1, (job, _starts(workers, job))


@pytest.mark.worker_env(LEASE_TEST_TTL="2", LEASE_TEST_HEARTBEAT="0.5")
def test_an_answered_duplicate_delivered_again_answers_nothing_twice(
        workers: WorkerPool) -> None:
    """The key is done under A; B (another id, with a plain link callback) is delivered
    twice: it is answered once (its callback runs once), and the second delivery of B is
    dropped as a duplicate of B's answer."""
    workers.start("a", concurrency=2)
    job = _job()
    assert workers.client.send_task(WORK, args=(job,), task_id=f"A-{job}").get(timeout=20)
    link = workers.client.signature("tests.support.worker_app.callback", kwargs={"tag": f"B-{job}"})
    for _ in range(2):
        workers.client.send_task(WORK, args=(job,), task_id=f"B-{job}", link=link)
    workers.journal.wait_for(
        lambda j: len(j.events("duplicate_ignored", key=answer_key(f"job:{job}", f"B-{job}")))
        >= 1, timeout=20, what="B's second delivery to be dropped")
    time.sleep(0.5)
    assert len(workers.journal.events("callback", tag=f"B-{job}")) == 1
    assert AsyncResult(f"B-{job}", app=workers.client).get(timeout=5)["token"] == 1
    assert len(_starts(workers, job)) == 1


def test_a_duplicate_of_a_dead_key_under_another_id_gets_its_failure(
        workers: WorkerPool) -> None:
    """The key went dead under A (a permanent error): B, under another id, is answered with
    the same failure, so ``AsyncResult(B)`` is FAILURE instead of PENDING for ever. It is A's
    own exception, as Celery re-raises a stored failure (it used to be ``LeaseDead``: the
    dead row now keeps the error it died of)."""
    workers.start("a", concurrency=2)
    job = _job()
    first = workers.client.send_task("tests.support.worker_app.always_fails",
                                     args=(job, "permanent"), task_id=f"A-{job}")
    with pytest.raises(Exception):  # noqa: B017 (the permanent error, as Celery reports it)
        first.get(timeout=20)
    second = workers.client.send_task("tests.support.worker_app.always_fails",
                                      args=(job, "permanent"), task_id=f"B-{job}")
    with pytest.raises(ValueError, match=f"permanent failure of {job}"):
        second.get(timeout=20)
    assert len(workers.journal.events("body_start", job_id=job)) <= 1
