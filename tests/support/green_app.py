"""tests/support/worker_app.py plus a CPU-bound task, for workers on the green pools
(``celery -A tests.support.green_app worker -P gevent|eventlet``,
tests/workers/test_green_pools.py)."""

from __future__ import annotations

import time
from typing import Any

from lease_celery import LeasedTask
from tests.support.worker_app import app, record

__all__ = ["app", "spin"]


@app.task(base=LeasedTask, bind=True, lease_key="job:{job_id}")
def spin(self: LeasedTask, job_id: str, seconds: float) -> dict[str, Any]:
    """Busy-loop for ``seconds`` without ever yielding to the hub (CPU-bound work: no I/O, no
    sleep), then check the lease; journal the start and the end."""
    lease = self.lease
    record("body_start", job_id=job_id, token=lease.token, owner=lease.owner,
           task_id=self.request.id)
    deadline = time.monotonic() + seconds
    spins = 0
    while time.monotonic() < deadline:
        spins += 1
    lease.check()
    record("body_end", job_id=job_id, token=lease.token, spins=spins)
    return {"job_id": job_id, "token": lease.token, "owner": lease.owner}
