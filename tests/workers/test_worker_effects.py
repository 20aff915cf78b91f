"""Effects with real workers: a real outside target, a real crash, a real takeover.

The target is a table in a SQLite file of the test's own (tests/support/worker_app.py::_target_send)
that records every request it receives with the idempotency key ``fn`` passed it, so the test
counts what really reached the outside world. Workers are ``celery worker`` subprocesses on a
Redis broker with ``task_acks_late`` and ``task_reject_on_worker_lost``, sharing a SQLite or a
PostgreSQL lease store (``worker_store``); they journal what their task bodies saw.
"""

from __future__ import annotations

import json
import sqlite3
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from lease_celery import EffectOutcomeUnknown, EffectState, LeaseState, Receipt, open_store
from tests.support.policy_helpers import cli_env, run_cli
from tests.support.workers import WorkerPool

pytestmark = pytest.mark.worker

PUBLISH_THEN_STALL = "tests.support.worker_app.publish_then_stall"
PUBLISH_THEN_DIE = "tests.support.worker_app.publish_then_die"


def _job() -> str:
    return uuid.uuid4().hex[:10]


def _received(target: Path) -> list[tuple[int, str, int]]:
    """Every request the target recorded: (row id, idempotency key, sender's lease token)."""
    if not target.exists():
        return []
    conn = sqlite3.connect(target)
    try:
        return list(conn.execute("SELECT id, idempotency_key, token FROM received ORDER BY id"))
    finally:
        conn.close()


def _receipt(workers: WorkerPool, key: str) -> Receipt:
    with open_store(workers.store_url) as store:
        receipt = store.effects.get(key)
    assert receipt is not None, f"no receipt for {key!r}"
    return receipt


def _tokens(workers: WorkerPool, event: str, job: str) -> list[Any]:
    return [e["token"] for e in workers.journal.events(event, job_id=job)]


@pytest.mark.parametrize("worker_store", ["sqlite", "postgres"], indirect=True)
@pytest.mark.worker_env(LEASE_TEST_TTL="1.5", LEASE_TEST_HEARTBEAT="0.4",
                        LEASE_TEST_VISIBILITY="4")
def test_lost_response_is_replayed_not_sent_again(workers: WorkerPool, tmp_path: Path) -> None:
    """The seed's lost-response case. Worker D performs the effect (the target records it) and
    is SIGKILLed before finishing the task. After the visibility timeout worker E gets the
    message, takes the expired lease over (token 2) and replays the effect with the same key:
    its ``self.effect`` returns D's recorded result without calling ``fn``, the target holds
    exactly one request, and E's result is the one accepted."""
    doomed = workers.start("d", concurrency=1)
    job, task_id = _job(), str(uuid.uuid4())
    key, target = f"publish:{job}:v1", tmp_path / "target.sqlite3"
    result = workers.client.send_task(PUBLISH_THEN_STALL, args=(job, str(target), 60.0),
                                      task_id=task_id)
    workers.journal.wait_for(lambda j: bool(j.events("effect_returned", job_id=job)),
                             timeout=20, what="worker D to perform the effect")
    doomed.kill()
    killed_at = time.time()
    workers.start("e", concurrency=1)

    outcome = result.get(timeout=60)
    sent = workers.journal.events("effect_returned", job_id=job, token=1)[0]["result"]
    assert sent == {"receipt_id": 1, "idempotency_key": key, "sent_by_token": 1}
    assert outcome == {"job_id": job, "token": 2, "sent": sent}
    assert _received(target) == [(1, key, 1)]
    assert _tokens(workers, "effect_fn_called", job) == [1]
    assert [(e["token"], e["result"]) for e in workers.journal.events(
        "effect_returned", job_id=job)] == [(1, sent), (2, sent)]
    starts = workers.journal.events("body_start", job_id=job)
    assert [s["token"] for s in starts] == [1, 2]
    assert starts[1]["t"] >= killed_at + 1.0  # not before D's lease expired
    receipt = _receipt(workers, key)
    assert (receipt.state, receipt.attempts, receipt.lease_token, receipt.result) == (
        EffectState.DONE, 1, 1, sent)
    with open_store(workers.store_url) as store:
        record = store.get(f"job:{job}")
    assert record is not None
    assert (record.state, record.token, record.result) == (LeaseState.DONE, 2, outcome)


@pytest.mark.parametrize("worker_store", ["sqlite", "postgres"], indirect=True)
@pytest.mark.worker_env(LEASE_TEST_TTL="1.5", LEASE_TEST_HEARTBEAT="0.4")
def test_outcome_lost_in_a_crash_needs_reconciliation_then_completes(
        workers: WorkerPool, tmp_path: Path) -> None:
    """The pool process dies inside ``fn`` right after the target recorded the request: the
    effect happened, its receipt was never marked done. The requeued delivery takes the lease
    over once it expired and does not resend: it fails with EffectOutcomeUnknown (FAILURE in
    the result backend, after whatever retries the failure policy allows, each of which also
    gets EffectOutcomeUnknown without calling ``fn``), and the receipt is
    ``needs_reconciliation``. A person checks the target, resolves the receipt with what it
    holds (and requeues the key if the policy left it dead); the same task id, published
    again, completes with that result, and the target still holds exactly one request."""
    workers.start("a", concurrency=1)
    job, task_id = _job(), str(uuid.uuid4())
    key, lease_key, target = f"publish:{job}:v1", f"job:{job}", tmp_path / "target.sqlite3"
    result = workers.client.send_task(PUBLISH_THEN_DIE, args=(job, str(target)),
                                      task_id=task_id)
    with pytest.raises(EffectOutcomeUnknown, match="needs reconciliation"):
        result.get(timeout=40)
    assert result.state == "FAILURE"
    assert _tokens(workers, "effect_fn_called", job) == [1]
    unknown = _tokens(workers, "effect_outcome_unknown", job)
    assert unknown and unknown[0] == 2 and unknown == sorted(set(unknown)), unknown
    assert _received(target) == [(1, key, 1)]
    receipt = _receipt(workers, key)
    assert (receipt.state, receipt.attempts, receipt.lease_token, receipt.result) == (
        EffectState.NEEDS_RECONCILIATION, 1, 1, None)
    with open_store(workers.store_url) as store:
        record = store.get(lease_key)
        assert record is not None and record.token == unknown[-1]
        assert record.state in (LeaseState.READY, LeaseState.DEAD)  # never done

        if record.state is LeaseState.DEAD:  # the reason sends a person to the command
            assert f"leases effects resolve {key} --result JSON" in (record.reason or "")
            assert f"leases effects discard {key}" in (record.reason or "")

        # Reconciliation: the target shows the request arrived; record what it answered,
        # with the command the reason names.
        [(row_id, _, _)] = _received(target)
        found = {"receipt_id": row_id, "idempotency_key": key, "sent_by_token": 1}
        resolved = run_cli(["effects", "resolve", key, "--result", json.dumps(found)],
                           env=cli_env(workers.store_url), cwd=tmp_path)
        assert resolved.returncode == 0, resolved.stderr
        reconciled = store.effects.get(key)
        assert reconciled is not None and reconciled.state is EffectState.DONE
        if record.state is LeaseState.DEAD:
            assert store.requeue(lease_key, reason="receipt reconciled") is not None

    result.forget()
    again = workers.client.send_task(PUBLISH_THEN_DIE, args=(job, str(target)), task_id=task_id)
    final_token = record.token + 1
    assert again.get(timeout=30) == {"job_id": job, "token": final_token, "sent": found}
    assert again.state == "SUCCESS"
    assert _received(target) == [(1, key, 1)]
    assert _tokens(workers, "effect_fn_called", job) == [1]
    assert [(e["token"], e["result"]) for e in workers.journal.events(
        "effect_returned", job_id=job)] == [(final_token, found)]
    with open_store(workers.store_url) as store:
        record = store.get(lease_key)
    assert record is not None and (record.state, record.token) == (LeaseState.DONE, final_token)
