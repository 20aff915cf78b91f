"""Long work with real workers: a takeover resumes from the checkpoint, and an operator's
cancel reaches the running body (or stops a key that has not started) and survives
redeliveries until a requeue."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from typing import Any

import pytest

from lease_celery import open_store
from lease_celery.models import LeaseRecord, LeaseState
from tests.support.policy_helpers import wait_until
from tests.support.workers import REPO, WorkerPool

WORK = "tests.support.worker_app.work"


def _job() -> str:
    return uuid.uuid4().hex[:10]


def _record(workers: WorkerPool, key: str) -> LeaseRecord | None:
    with open_store(workers.store_url) as store:
        return store.get(key)


def _checkpointed(workers: WorkerPool, key: str) -> int:
    """The last step the key's checkpoint in the store holds (0: none yet)."""
    record = _record(workers, key)
    return int(((record and record.checkpoint) or {}).get("done", 0))


def _cli(workers: WorkerPool, *args: str) -> subprocess.CompletedProcess[str]:
    """``python -m lease_celery -A tests.support.worker_app --store URL ...``, configured as the
    workers are (so ``requeue`` publishes to their queue)."""
    return subprocess.run([sys.executable, "-m", "lease_celery", "-A", "tests.support.worker_app",
                           "--store", workers.store_url, *args], cwd=REPO,
                          env={**os.environ, **workers.env}, capture_output=True, text=True,
                          timeout=60)


@pytest.mark.worker_env(LEASE_TEST_TTL="2", LEASE_TEST_HEARTBEAT="0.5")
def test_a_takeover_resumes_from_the_checkpoint_the_killed_owner_left(
        workers: WorkerPool) -> None:
    """Ten steps, a checkpoint after each; the worker is SIGKILLed after step 3. The next
    owner (token 2) starts from the checkpoint and runs steps 4-10 only, each once."""
    doomed = workers.start("doomed", concurrency=1)
    job = _job()
    result = workers.client.send_task("tests.support.worker_app.stepper", args=(job, 10, 0.3))
    workers.journal.wait_for(lambda j: bool(j.events("step", job_id=job, step=3)),
                             timeout=20, what="step 3")
    # The body journals a step just before it checkpoints it: wait for the store to hold step
    # 3 too, or a kill in between leaves {"done": 2} (CI saw that once under load).
    wait_until(lambda: _checkpointed(workers, f"job:{job}") >= 3, timeout=20,
               what="step 3's checkpoint in the store")
    doomed.kill()
    with open_store(workers.store_url) as store:
        checkpoint = store.get(f"job:{job}").checkpoint  # type: ignore[union-attr]
    assert checkpoint in ({"done": 3}, {"done": 4})  # step 4 may have landed before the kill
    workers.start("survivor", concurrency=1)
    assert result.get(timeout=60) == {"job_id": job, "token": 2, "steps": 10}
    steps = [(e["step"], e["token"]) for e in workers.journal.events("step", job_id=job)]
    resumed = checkpoint["done"]
    assert steps == [(n, 1) for n in range(1, resumed + 1)] + [
        (n, 2) for n in range(resumed + 1, 11)], steps
    starts = workers.journal.events("body_start", job_id=job)
    assert [(s["token"], s["resumed_after"]) for s in starts] == [(1, 0), (2, resumed)]
    record = _record(workers, f"job:{job}")
    assert record is not None and record.state is LeaseState.DONE
    assert record.checkpoint is None  # cleared when the key is done
    # The history tells the story, as the store wrote it with each transition: the first
    # claim, its takeover, the finish (and maybe the sweeper's re-publish in between).
    with open_store(workers.store_url) as store:
        events = [(e.event, e.token) for e in store.history(f"job:{job}")]
    transitions = [e for e in events if e[0] != "swept"]
    assert transitions == [("claimed", 1), ("taken_over", 2), ("finished", 2)], events


@pytest.mark.worker_env(LEASE_TEST_TTL="2", LEASE_TEST_HEARTBEAT="0.5")
def test_a_cancel_reaches_the_running_body_and_survives_redeliveries_until_requeued(
        workers: WorkerPool) -> None:
    """``celery leases cancel`` while the body runs: within a heartbeat interval its
    ``check()`` raises LeaseCancelled, the key ends dead "cancelled: ...", the backend has a
    FAILURE. A redelivery of the task is dropped; ``requeue`` brings the key back and it
    runs again, no longer cancelled."""
    workers.start("a", concurrency=1)
    job, task_id = _job(), str(uuid.uuid4())
    key = f"job:{job}"
    result = workers.client.send_task(WORK, args=(job, 30.0), task_id=task_id)
    workers.journal.wait_for(lambda j: bool(j.events("body_start", job_id=job)), timeout=20,
                             what="the body to start")
    cancelled = _cli(workers, "cancel", key, "--reason", "runaway <b>")
    assert cancelled.returncode == 0, cancelled.stderr
    assert "its holder stops at its next heartbeat" in cancelled.stdout
    with pytest.raises(Exception, match="cancelled: runaway <b>"):
        result.get(timeout=20)
    lost = workers.journal.events("body_lease_lost", job_id=job)
    assert lost and "cancelled: runaway <b>" in lost[0]["reason"]
    # How soon the body knew: from the cancel's write (the CLI records operator:cancel just
    # after it) to the body's journal entry, both wall clocks of this host. One heartbeat
    # interval (0.5 s) at most, plus slack for a loaded 2-core machine (the renewal's round
    # trip, the body's check every 0.1 s, the journal write).
    with open_store(workers.store_url) as store:
        cancel_at = next(e.at for e in store.history(key) if e.event == "operator:cancel")
    assert lost[0]["t"] - cancel_at < 0.5 + 2.0, (lost[0]["t"] - cancel_at)
    record = _record(workers, key)
    assert record is not None and record.state is LeaseState.DEAD
    assert record.reason == "cancelled: runaway <b>"
    shown = _cli(workers, "show", key)
    assert "cancelled: runaway <b>" in shown.stdout

    workers.client.send_task(WORK, args=(job, 0.0), task_id=task_id)  # a redelivery
    workers.journal.wait_for(
        lambda j: bool(j.events("duplicate_ignored", key=key)), timeout=20,
        what="the redelivery to be dropped")
    assert len(workers.journal.events("body_start", job_id=job)) == 1

    requeued = _cli(workers, "requeue", key)
    assert requeued.returncode == 0, requeued.stderr
    workers.journal.wait_for(  # the recorded task (the same 30 s body) runs again
        lambda j: [e["token"] for e in j.events("body_start", job_id=job)] == [1, 2],
        timeout=20, what="the requeued key to run again")
    record = _record(workers, key)
    assert record is not None and record.state is LeaseState.RUNNING and record.cancel is None


@pytest.mark.worker_env(LEASE_TEST_TTL="2", LEASE_TEST_HEARTBEAT="0.5")
def test_a_key_cancelled_before_it_started_never_runs(workers: WorkerPool) -> None:
    """Cancelled before any delivery: the delivery that comes later never runs the body, and
    its AsyncResult is a FAILURE naming the cancel (not PENDING for ever)."""
    workers.start("a", concurrency=1)
    job = _job()
    with open_store(workers.store_url) as store:
        assert store.cancel(f"job:{job}", reason="not wanted")
    result: Any = workers.client.send_task(WORK, args=(job, 0.0))
    with pytest.raises(Exception, match="cancelled: not wanted"):
        result.get(timeout=20)
    assert workers.journal.events("body_start", job_id=job) == []
