"""A LeasedTask does what the same plain Celery task does, outside the lease's own promises
(one accepted outcome per key; a duplicate of a running key deferred, of a done key answered;
a stale finish refused): docs/guarantees.md lists what remains different, and why.

Each case was a difference that Celery's own integration tests found with every task leased
(``python -m benchmarks.celery_compat``): an exception retried by default, ``self.retry()``
cut off by ``lease_max_attempts``, a retry's countdown cut short by the sweeper re-running the
failed attempt, ``Reject`` and ``Ignore`` run again, ``replace()`` counted as an attempt.
Real ``celery worker`` processes on a Redis broker; runs are read from the journal the task
bodies write (tests/support/semantics_tasks.py) and from the lease row.
"""

from __future__ import annotations

import time
import uuid

import pytest
from celery import chain, chord

from lease_celery import LeaseState, open_store
from tests.support.policy_helpers import get_record, wait_until
from tests.support.workers import WorkerPool

pytestmark = pytest.mark.worker

TASKS = "tests.support.semantics_tasks"
#: A sweeper that looks often and re-publishes a claimable, unclaimed row after a second: what
#: it may re-run shows within the test's few seconds.
QUICK_SWEEPER = {"LEASE_TEST_SWEEP_INTERVAL": "0.3", "LEASE_TEST_SWEEP_GRACE": "1"}


def _job() -> str:
    return uuid.uuid4().hex[:10]


def _runs(workers: WorkerPool, job: str) -> list[dict]:
    return workers.journal.events("body_start", job_id=job)


def test_an_exception_fails_the_task_at_once(workers: WorkerPool) -> None:
    """A body that raises an error the task declares no retry for runs once, as in Celery:
    FAILURE with that error, its ``link_error`` errback called once, the row dead after one
    attempt. (The lease used to retry every exception up to ``lease_max_attempts``: Celery's
    own integration test ``test_link_error_using_signature`` saw the failing task run 3 times.)
    """
    workers.start("a", concurrency=1)
    job = _job()
    errback = workers.client.signature("tests.support.semantics_tasks.errback_journal",
                                       args=(job,))
    result = workers.client.send_task(f"{TASKS}.plain_failure", args=(job,),
                                      link_error=errback)
    assert isinstance(result.get(timeout=30, propagate=False), RuntimeError)
    assert result.state == "FAILURE"
    wait_until(lambda: workers.journal.events("errback", tag=job), timeout=10,
               what="the errback")
    time.sleep(1.5)  # a retry the lease added would have run by now (backoff 0.5-1 s)
    assert [r["attempts"] for r in _runs(workers, job)] == [1]
    assert len(workers.journal.events("errback", tag=job)) == 1
    record = get_record(workers.store_url, f"job:{job}")
    assert record is not None and record.state is LeaseState.DEAD
    assert record.attempts == 1 and "RuntimeError" in (record.reason or "")


def test_celery_retries_are_not_capped_by_lease_max_attempts(workers: WorkerPool) -> None:
    """``self.retry()`` with ``max_retries=4`` runs five times and succeeds under the default
    ``lease_max_attempts`` (3): Celery's retries are the task's own control flow and give
    their attempt back (Celery's ``test_retry`` stopped after 3 runs). The row ends done with
    one attempt counted."""
    workers.start("a", concurrency=1)
    job = _job()
    result = workers.client.send_task(f"{TASKS}.retried_four_times", args=(job,))
    assert result.get(timeout=30) == {"job_id": job, "retries": 4}
    assert [r["retries"] for r in _runs(workers, job)] == [0, 1, 2, 3, 4]
    assert [r["attempts"] for r in _runs(workers, job)] == [1, 1, 1, 1, 1]
    record = get_record(workers.store_url, f"job:{job}")
    assert record is not None and record.state is LeaseState.DONE and record.attempts == 1


@pytest.mark.worker_env(**QUICK_SWEEPER)
def test_a_retry_countdown_is_kept_and_the_failed_attempt_never_runs_again(
        workers: WorkerPool) -> None:
    """``self.retry(countdown=6)`` under a sweeper with a 1 s grace: the retry runs once, 6 s
    later, with ``retries=1``; the failed attempt never runs again. Meanwhile the row is ready,
    claimable from the retry's due time, and carries the retry's message (retries 1), so a
    lost retry message is re-published as the retry, after its countdown. (The sweeper used
    to re-publish the first message a grace period after the release: the first attempt ran
    again, early, with retries=0.)"""
    workers.start("a", concurrency=1)
    job, countdown = _job(), 6.0
    result = workers.client.send_task(f"{TASKS}.retried_later", args=(job, countdown))
    wait_until(lambda: _runs(workers, job), timeout=15, what="the first run")
    first = _runs(workers, job)[0]["t"]
    time.sleep(2.5)  # two grace periods after the release
    record = get_record(workers.store_url, f"job:{job}")
    assert record is not None and record.state is LeaseState.READY
    assert record.not_before is not None
    assert record.not_before == pytest.approx(first + countdown, abs=1.0)
    assert record.task is not None and record.task["options"]["retries"] == 1
    assert [r["retries"] for r in _runs(workers, job)] == [0]

    assert result.get(timeout=30) == {"job_id": job, "retries": 1}
    runs = _runs(workers, job)
    assert [r["retries"] for r in runs] == [0, 1]
    assert runs[1]["t"] - first >= countdown - 0.5
    time.sleep(1.5)
    assert len(_runs(workers, job)) == 2


@pytest.mark.worker_env(**QUICK_SWEEPER)
def test_reject_and_ignore_end_the_key_and_never_run_again(workers: WorkerPool) -> None:
    """A body that raises ``Reject(requeue=False)`` or ``Ignore`` runs once, as in Celery,
    even with a sweeper that re-publishes any claimable row a second after it became
    claimable: the rejected key ends dead ("rejected"), the ignored one done, both settled.
    (Both used to be released: the sweeper ran them again, 3 to 4 times, and a rejected
    task's failure was overwritten by LeaseDead.)"""
    workers.start("a", concurrency=1)
    reject, ignore = _job(), _job()
    workers.client.send_task(f"{TASKS}.rejected", args=(reject,))
    workers.client.send_task(f"{TASKS}.ignored", args=(ignore,))
    wait_until(lambda: _runs(workers, reject) and _runs(workers, ignore), timeout=15,
               what="both runs")
    time.sleep(3.0)  # three grace periods
    assert len(_runs(workers, reject)) == 1
    assert len(_runs(workers, ignore)) == 1
    rejected = get_record(workers.store_url, f"job:{reject}")
    assert rejected is not None and rejected.state is LeaseState.DEAD
    assert "rejected" in (rejected.reason or "").lower() and not rejected.settling
    ignored = get_record(workers.store_url, f"job:{ignore}")
    assert ignored is not None and ignored.state is LeaseState.DONE and not ignored.settling


def test_replace_hands_the_key_on_without_counting_an_attempt(workers: WorkerPool) -> None:
    """A task keyed by its id that replaces itself four levels deep (Celery gives each
    replacement the same id, so the same key) runs five times and returns 4, as in Celery
    (``test_replaced_task_nesting_increments``): each replacement takes the key over from its
    predecessor, and none counts as an attempt (the fourth used to end LeaseDead)."""
    workers.start("a", concurrency=1)
    job = _job()
    result = workers.client.send_task(f"{TASKS}.replaced", args=(job, 4))
    assert result.get(timeout=30) == 4
    runs = _runs(workers, job)
    assert [r["nesting"] for r in runs] == [0, 1, 2, 3, 4]
    assert {r["task_id"] for r in runs} == {result.id}
    assert [r["attempts"] for r in runs] == [1, 1, 1, 1, 1]
    record = get_record(workers.store_url, result.id)
    assert record is not None and record.state is LeaseState.DONE and record.attempts == 1
    # A late copy of the first message (a broker's redelivery) comes from the same place as
    # the replacements, which keep its context: dropped, not answered with its callbacks.
    workers.client.send_task(f"{TASKS}.replaced", args=(job, 4), task_id=result.id)
    wait_until(lambda: workers.journal.events("duplicate_ignored", key=result.id), timeout=15,
               what="the copy dropped")
    with open_store(workers.store_url) as store:
        assert store.find(prefix=f"{result.id}#answer") == []
    assert len(_runs(workers, job)) == 5


def test_a_chord_whose_header_chain_fails_calls_its_errback_once(workers: WorkerPool) -> None:
    """A chord whose header is a chain that fails in its middle, every task leased and keyed
    by its id (Celery's ``test_mutable_errback_called_by_chord_from_chain``): the chord's
    result raises the error and its ``link_error`` errback is called once, the failing task
    having run once. (The failing task used to be retried, and the errback never came.)"""
    workers.start("a", concurrency=2)
    job = _job()
    client = workers.client
    header = chain(client.signature(f"{TASKS}.identity", args=(42,), immutable=True),
                   client.signature(f"{TASKS}.fails", args=(job,), immutable=True),
                   client.signature(f"{TASKS}.identity", args=(42,), immutable=True))
    flow = chord((header,), client.signature(f"{TASKS}.identity"))
    flow.link_error(client.signature(f"{TASKS}.errback_journal", args=(job,)))
    result = flow.apply_async()
    with pytest.raises(RuntimeError, match=f"failure of {job}"):
        result.get(timeout=30)
    wait_until(lambda: workers.journal.events("errback", tag=job), timeout=15,
               what="the chord's errback")
    time.sleep(1.5)  # a second errback, or a retry of the failed task, would come by now
    assert len(workers.journal.events("errback", tag=job)) == 1
    assert len(_runs(workers, job)) == 1


def test_a_frozen_signature_applied_in_a_second_chain_is_answered_there(
        workers: WorkerPool) -> None:
    """A signature frozen once (its task id fixed) and applied in two chains, keyed by its id:
    plain Celery runs it in each, and each chain goes on. Leased, its body runs once (one
    accepted outcome per key); the second chain, a new context for the same id, gets that
    outcome and goes on (a broker's redelivery of the *same* message is still dropped)."""
    workers.start("a", concurrency=2)
    job = _job()
    client = workers.client
    shared = client.signature(f"{TASKS}.once", args=(job,), immutable=True)
    shared.freeze()
    first = chain(shared, client.signature(f"{TASKS}.identity")).apply_async()
    assert first.get(timeout=30) == f"done {job}"
    second = chain(client.signature(f"{TASKS}.identity", args=(1,), immutable=True), shared,
                   client.signature(f"{TASKS}.identity")).apply_async()
    assert second.get(timeout=30) == f"done {job}"
    assert len(_runs(workers, job)) == 1


def test_a_frozen_failing_signature_in_a_second_chord_fails_it_with_its_error(
        workers: WorkerPool) -> None:
    """Celery's ``test_mutable_errback_called_by_chord_from_chain``: one chain of frozen
    signatures is a chord's header, then another chord's body. The failing task runs once;
    the second chord fails with the task's own error (not ``LeaseDead``) and calls its own
    errback for the failing task."""
    workers.start("a", concurrency=2)
    job = _job()
    client = workers.client
    failing = client.signature(f"{TASKS}.fails", args=(job,), immutable=True)
    failing_id = failing.freeze().id
    header = chain(client.signature(f"{TASKS}.identity", args=(42,), immutable=True), failing,
                   client.signature(f"{TASKS}.identity", args=(42,), immutable=True))
    flow = chord((header,), client.signature(f"{TASKS}.identity"))
    flow.link_error(client.signature(f"{TASKS}.errback_journal", args=(job,)))
    with pytest.raises(RuntimeError, match=f"failure of {job}"):
        flow.apply_async().get(timeout=30)
    wait_until(lambda: workers.journal.events("errback", tag=job), timeout=15,
               what="the first chord's errback")
    again = chord((client.signature(f"{TASKS}.identity", args=(42,), immutable=True),), header)
    again.link_error(client.signature(f"{TASKS}.errback_journal", args=(f"{job}-2",)))
    with pytest.raises(RuntimeError, match=f"failure of {job}"):
        again.apply_async().get(timeout=30)
    wait_until(lambda: [e for e in workers.journal.events("errback", tag=f"{job}-2")
                        if e["task_id"] == failing_id],
               timeout=15, what="the second chord's errback, for the failing task")
    assert len(_runs(workers, job)) == 1
