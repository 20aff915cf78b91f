"""The Celery app that the worker tests run in real ``celery worker`` processes.

Configured from the environment (set by tests/workers.py): broker and result backend on a
Redis database of the test run's own, the lease store URL, the queue, and a journal (a Redis
list) where task bodies and lease signals record what really happened, as seen by the worker.
"""

from __future__ import annotations

import json
import os
import socket
import time
from typing import Any

import redis
from celery import Celery, signals

import lease_celery
from lease_celery import LeasedTask, LeaseLost

BROKER = os.environ.get("LEASE_TEST_BROKER", "redis://127.0.0.1:6379/11")
JOURNAL = os.environ.get("LEASE_TEST_JOURNAL", "journal")

app = Celery("worker_app", broker=BROKER, backend=BROKER)
app.conf.update(
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=1,
    task_default_queue=os.environ.get("LEASE_TEST_QUEUE", "lease-tests"),
    broker_transport_options={
        "visibility_timeout": float(os.environ.get("LEASE_TEST_VISIBILITY", "3600")),
        "unacked_restore_interval": 1,
        "unacked_restore_throttle": 1,
    },
    result_expires=600,
    lease_store_url=os.environ.get("LEASE_TEST_STORE", "sqlite:///lease_celery.sqlite3"),
    lease_ttl=float(os.environ.get("LEASE_TEST_TTL", "2")),
    lease_heartbeat_interval=float(os.environ.get("LEASE_TEST_HEARTBEAT", "0.5")),
    worker_hijack_root_logger=False,
)

_redis: redis.Redis | None = None


def record(event: str, **fields: Any) -> None:
    """Append one event to the journal list (the test reads it back in order)."""
    global _redis
    if _redis is None:
        _redis = redis.Redis.from_url(BROKER)
    entry = {"event": event, "pid": os.getpid(), "host": socket.gethostname(),
             "t": time.time(), **fields}
    _redis.rpush(JOURNAL, json.dumps(entry, default=str))


@app.task(base=LeasedTask, bind=True, lease_key="job:{job_id}")
def work(self: LeasedTask, job_id: str, seconds: float = 0.0,
         check_every: float = 0.1) -> dict[str, Any]:
    """Run for ``seconds``, checking the lease; record start, loss and end in the journal."""
    lease = self.lease
    record("body_start", job_id=job_id, token=lease.token, owner=lease.owner,
           task_id=self.request.id)
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            time.sleep(check_every)
            lease.check()
    except LeaseLost as exc:
        record("body_lease_lost", job_id=job_id, token=lease.token, reason=str(exc))
        raise
    record("body_end", job_id=job_id, token=lease.token)
    return {"job_id": job_id, "token": lease.token, "owner": lease.owner}


@app.task(base=LeasedTask, bind=True, lease_key="job:{job_id}")
def unchecked(self: LeasedTask, job_id: str, seconds: float = 0.0) -> dict[str, Any]:
    """Sleep without checking the lease: a worker that stalls finishes late and is fenced."""
    record("body_start", job_id=job_id, token=self.lease.token, owner=self.lease.owner,
           task_id=self.request.id)
    time.sleep(seconds)
    record("body_end", job_id=job_id, token=self.lease.token)
    return {"job_id": job_id, "token": self.lease.token, "pid": os.getpid()}


@app.task
def callback(result: Any, tag: str) -> None:
    """A ``link`` callback: records that it ran and with which result."""
    record("callback", tag=tag, result=result)


@signals.worker_ready.connect
def _ready(sender: Any = None, **_: Any) -> None:
    record("worker_ready", hostname=sender.hostname if sender is not None else None)


def _journal_signal(name: str) -> None:
    def receiver(sender: Any = None, key: str | None = None, **fields: Any) -> None:
        lease = fields.pop("lease", None)
        fields.pop("signal", None)
        fields.pop("record", None)
        record(name, key=key, token=getattr(lease, "token", None), **fields)

    getattr(lease_celery.signals, name).connect(receiver, weak=False)


for _name in ("lease_acquired", "lease_lost", "duplicate_deferred", "duplicate_ignored",
              "stale_result_rejected", "lease_released"):
    _journal_signal(_name)


@app.task(base=LeasedTask, bind=True, lease_key="job:{job_id}", max_retries=3)
def flaky(self: LeasedTask, job_id: str, failures: int) -> dict[str, Any]:
    """Fail ``failures`` times through Celery's own ``self.retry()``, then succeed."""
    record("body_start", job_id=job_id, token=self.lease.token, retries=self.request.retries)
    if self.request.retries < failures:
        raise self.retry(countdown=0.2, exc=RuntimeError(f"attempt {self.request.retries}"))
    return {"job_id": job_id, "token": self.lease.token, "retries": self.request.retries}


@app.task(base=LeasedTask, bind=True, lease_key="job:{job_id}")
def not_json(self: LeasedTask, job_id: str) -> object:
    """Return a value the lease store refuses (not JSON)."""
    return {1, 2, 3}


def _explode(**_: Any) -> None:
    raise RuntimeError("a faulty receiver")


if os.environ.get("LEASE_TEST_FAULTY_RECEIVERS"):
    for _name in ("lease_acquired", "lease_renewed", "lease_released"):
        getattr(lease_celery.signals, _name).connect(_explode, weak=False)


@app.task(base=LeasedTask, bind=True, lease_key="job:{job_id}")
def fenced_write(self: LeasedTask, job_id: str, seconds: float) -> dict[str, Any]:
    """Sleep (unchecked), then write a business row in the lease's own transaction."""
    import sqlite3

    token = self.lease.token
    record("body_start", job_id=job_id, token=token, task_id=self.request.id)
    time.sleep(seconds)
    try:
        with self.lease.fenced() as conn:
            if isinstance(conn, sqlite3.Connection):
                conn.execute("CREATE TABLE IF NOT EXISTS biz_writes (job_id TEXT, token INT)")
                conn.execute("INSERT INTO biz_writes VALUES (?, ?)", (job_id, token))
            else:
                table = f'"{self.lease_store.schema}".biz_writes'
                conn.execute(f"CREATE TABLE IF NOT EXISTS {table} (job_id text, token int)")
                conn.execute(f"INSERT INTO {table} VALUES (%s, %s)", (job_id, token))
    except LeaseLost as exc:
        record("fenced_refused", job_id=job_id, token=token, reason=str(exc))
        raise
    record("fenced_committed", job_id=job_id, token=token)
    return {"job_id": job_id, "token": token}
