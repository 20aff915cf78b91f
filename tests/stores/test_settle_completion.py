"""A delivery that completes a settling key whose owner looked dead, in process through
Celery's own tracer on a real SQLite store and Celery's in-memory cache backend.

The chaos harness's short Redis run (CI) found the case: an owner held between its accepted
finish and Celery's result write, its renewals slowed by the store, stored SUCCESS after its
settle deadline had passed; a redelivery of the same task id then completed the key and
stored SUCCESS a second time, while the first writer was alive.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest
from celery import Celery
from celery.app.trace import build_tracer

from lease_celery import LeasedTask, LeaseState, open_store
from lease_celery.runtime.execution import Phase


def _app(sqlite_url: str) -> tuple[Celery, Any]:
    app = Celery(f"completion-{uuid.uuid4().hex[:6]}", broker="memory://",
                 backend="cache+memory://", set_as_current=False)
    app.conf.update(lease_store_url=sqlite_url, lease_sweep_interval=0, lease_ttl=0.3,
                    lease_heartbeat_interval=0.1)

    @app.task(bind=True, base=LeasedTask, lease_key="job:{n}", shared=False)
    def job(self: LeasedTask, n: int) -> Any:
        return {"ran": n}

    app.finalize()
    return app, job


def _trace(app: Celery, task: Any, task_id: str, *args: Any) -> Any:
    tracer = build_tracer(task.name, task, app=app, eager=False, propagate=False)
    message = {"id": task_id, "task": task.name, "args": list(args), "kwargs": {},
               "delivery_info": {"routing_key": "celery", "exchange": "", "priority": 0,
                                 "redelivered": True}, "hostname": "test"}
    return tracer(task_id, args, {}, message)


def _owner_stored_then_missed_its_deadline(app: Celery, task: Any, url: str, task_id: str,
                                           *, stored: bool) -> None:
    """An owner claimed, finished (settling), stored the outcome in the backend if
    ``stored``, and never confirmed: its settle deadline passes."""
    with open_store(url) as store:
        lease = store.claim("job:1", owner="host:1:owner/1", ttl=5, task={
            "task": task.name, "id": task_id, "args": [1], "kwargs": {},
            "options": {"task_id": task_id}})
        assert lease is not None
        assert store.finish(lease, {"ran": 1}, settle_within=0.2)
    if stored:
        app.backend.mark_as_done(task_id, {"ran": 1})
    time.sleep(0.3)


@pytest.mark.parametrize("stored", [True, False], ids=["owner-stored-it", "owner-died"])
def test_a_completion_stores_the_outcome_only_if_the_owner_did_not(
        sqlite_url: str, monkeypatch: pytest.MonkeyPatch, stored: bool) -> None:
    """Past the settle deadline a redelivery takes the settlement over. If Celery's backend
    already holds the task id's SUCCESS (the owner was slow, not dead: results are stored
    after the callbacks are sent), it confirms the settlement and stores nothing again;
    otherwise it stores the accepted outcome, as before. Either way the key is settled."""
    app, job = _app(sqlite_url)
    task_id = f"t-{uuid.uuid4().hex[:8]}"
    _owner_stored_then_missed_its_deadline(app, job, sqlite_url, task_id, stored=stored)
    writes: list[str] = []
    real = app.backend.mark_as_done

    def counted(tid: str, *args: Any, **kwargs: Any) -> Any:
        writes.append(tid)
        return real(tid, *args, **kwargs)

    monkeypatch.setattr(app.backend, "mark_as_done", counted)
    _trace(app, job, task_id, 1)
    assert writes == ([] if stored else [task_id])
    assert app.AsyncResult(task_id).result == {"ran": 1}
    with open_store(sqlite_url) as store:
        deadline = time.monotonic() + 5
        while True:
            record = store.get("job:1")
            assert record is not None and record.state is LeaseState.DONE
            if not record.settling or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        assert not record.settling and record.owner != "host:1:owner/1"


def test_an_owner_frozen_past_its_settle_deadline_does_not_store_over_the_completer(
        sqlite_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The owner finishes, then is frozen (its heartbeat too) between the finish and Celery's
    result write for longer than the settle deadline; a redelivery takes the settlement over
    and stores the outcome. When the owner resumes, Celery's result write finds the
    settlement gone and stores nothing (before: the same result, written twice). An owner that
    is merely past its local deadline, with the settlement still its own, stores as usual."""
    from celery.canvas import Signature

    from lease_celery.runtime.heartbeat import Heartbeat

    for taken_over in (True, False):
        app, job = _app(sqlite_url)
        task_id = f"t-{uuid.uuid4().hex[:8]}"
        writes: list[str] = []
        real = app.backend.mark_as_done

        def counted(tid: str, *args: Any, _real: Any = real, _writes: list[str] = writes,
                    **kwargs: Any) -> Any:
            _writes.append(tid)
            return _real(tid, *args, **kwargs)

        monkeypatch.setattr(app.backend, "mark_as_done", counted)

        def frozen(signature: Any, *args: Any, _taken: bool = taken_over, _job: Any = job,
                   **kwargs: Any) -> None:
            """Celery sends the callbacks between the finish and the result write: freeze
            there, as a SIGSTOP would (the heartbeat stops renewing), past the deadline."""
            handle = _job.request.lease
            Heartbeat.for_process().unwatch(handle)
            handle.enter(Phase.SETTLING)  # still settling: only its renewals stopped
            time.sleep(0.45)
            if _taken:
                with open_store(sqlite_url) as store:
                    assert store.claim_settlement(handle.key, owner="host:2:completer/1",
                                                  ttl=5) is not None
            handle._deadline = time.monotonic() - 1  # its own clock saw the lapse

        monkeypatch.setattr(Signature, "apply_async", frozen)
        tracer = build_tracer(job.name, job, app=app, eager=False, propagate=False)
        key = f"{uuid.uuid4().hex[:6]}"
        message = {"id": task_id, "task": job.name, "args": [key], "kwargs": {},
                   "callbacks": [dict(app.signature("proj.callback"))],
                   "delivery_info": {"routing_key": "celery", "exchange": "", "priority": 0,
                                     "redelivered": False}, "hostname": "test"}
        tracer(task_id, [key], {}, message)
        assert writes == ([] if taken_over else [task_id]), taken_over
        monkeypatch.undo()
