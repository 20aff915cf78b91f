"""Tasks of tests/workers/test_celery_semantics.py: a LeasedTask must do what the same plain
Celery task does, outside the lease's own promises (exceptions, retries with a countdown,
``Reject``, ``Ignore``, ``replace()``). Registered on the worker tests' app (worker_app.py
imports this module), each journals its runs."""

from __future__ import annotations

from typing import Any

from celery.exceptions import Ignore, Reject

from lease_celery import LeasedTask
from tests.support.worker_app import app, record


def _start(task: LeasedTask, job_id: str, **fields: Any) -> None:
    record("body_start", job_id=job_id, token=task.lease.token,
           attempts=task.lease.attempts, retries=task.request.retries,
           task_id=task.request.id, **fields)


@app.task(base=LeasedTask, bind=True, lease_key="job:{job_id}")
def plain_failure(self: LeasedTask, job_id: str) -> None:
    """Raise an error the task declares no retry for: Celery fails it at once."""
    _start(self, job_id)
    raise RuntimeError(f"failure of {job_id}")


@app.task(base=LeasedTask, bind=True, lease_key="job:{job_id}", max_retries=4)
def retried_four_times(self: LeasedTask, job_id: str) -> dict[str, Any]:
    """Celery's own ``self.retry()`` four times (``max_retries=4``), then success: above the
    lease's default ``lease_max_attempts`` (3)."""
    _start(self, job_id)
    if self.request.retries < 4:
        raise self.retry(countdown=0.1, exc=RuntimeError(f"retry {self.request.retries}"))
    return {"job_id": job_id, "retries": self.request.retries}


@app.task(base=LeasedTask, bind=True, lease_key="job:{job_id}")
def retried_later(self: LeasedTask, job_id: str, countdown: float) -> dict[str, Any]:
    """One ``self.retry(countdown=...)``, then success."""
    _start(self, job_id)
    if self.request.retries < 1:
        raise self.retry(countdown=countdown, exc=RuntimeError("not yet"))
    return {"job_id": job_id, "retries": self.request.retries}


@app.task(base=LeasedTask, bind=True, lease_key="job:{job_id}")
def rejected(self: LeasedTask, job_id: str) -> None:
    """``Reject(requeue=False)``: Celery drops the message (or dead-letters it)."""
    _start(self, job_id)
    raise Reject("no thanks", requeue=False)


@app.task(base=LeasedTask, bind=True, lease_key="job:{job_id}")
def ignored(self: LeasedTask, job_id: str) -> None:
    """``Ignore``: Celery acks the message and records nothing."""
    _start(self, job_id)
    raise Ignore()


@app.task(base=LeasedTask, bind=True)
def replaced(self: LeasedTask, job_id: str, levels: int) -> Any:
    """Replace itself ``levels`` times (keyed by task id: Celery gives each replacement this
    task's id), then return how deep it went."""
    _start(self, job_id, nesting=self.request.get("replaced_task_nesting", 0))
    if levels > 0:
        return self.replace(replaced.s(job_id, levels - 1))
    return self.request.get("replaced_task_nesting", 0)


@app.task
def errback_journal(request: Any, exc: Any, traceback: Any, tag: str) -> None:
    """A ``link_error`` errback: records that it ran."""
    record("errback", tag=tag, task_id=getattr(request, "id", None), error=repr(exc))


@app.task(base=LeasedTask, bind=True)
def identity(self: LeasedTask, value: Any) -> Any:
    """Return ``value`` (keyed by task id, as every task of Celery's own canvas tests)."""
    return value


@app.task(base=LeasedTask, bind=True)
def fails(self: LeasedTask, job_id: str) -> None:
    """Raise at once (keyed by task id)."""
    _start(self, job_id)
    raise RuntimeError(f"failure of {job_id}")


@app.task(base=LeasedTask, bind=True)
def once(self: LeasedTask, job_id: str) -> str:
    """Return a value naming ``job_id`` (keyed by task id): journals each run."""
    _start(self, job_id)
    return f"done {job_id}"
