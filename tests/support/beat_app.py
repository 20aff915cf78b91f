"""The Celery app that tests/workers/test_beat.py runs in real ``celery beat`` and ``celery worker``
processes.

Configured from the environment: a broker on a Redis database of these tests' own, a queue
and exchange per test module run, the lease store, the journal (a Redis list), and one
interval entry whose name and period each test chooses. Beats journal every message they
publish (``sent``); the task body journals every run (``run``) with the slot it was sent for.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import redis
from celery import Celery, signals

from lease_celery import LeasedTask
from lease_celery import signals as lease_signals
from lease_celery.beat import SLOT, request_slot

BROKER = os.environ.get("LEASE_TEST_BEAT_BROKER", "redis://127.0.0.1:6379/7")
JOURNAL = os.environ.get("LEASE_TEST_BEAT_JOURNAL", "beat-journal")
QUEUE = os.environ.get("LEASE_TEST_BEAT_QUEUE", "lease-beat-tests")
ENTRY = os.environ.get("LEASE_TEST_BEAT_ENTRY", "tick")
ROLE = os.environ.get("LEASE_TEST_BEAT_ROLE", "")

app = Celery("beat_app", broker=BROKER)
app.conf.update(
    task_default_queue=QUEUE,
    task_default_exchange=QUEUE,  # an exchange of its own: its binding key is ours to delete
    task_default_routing_key=QUEUE,
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=1,
    task_ignore_result=True,
    lease_store_url=os.environ.get("LEASE_TEST_BEAT_STORE", "sqlite:///lease_celery.sqlite3"),
    lease_ttl=2.0,
    lease_heartbeat_interval=0.5,
    worker_hijack_root_logger=False,
    worker_enable_remote_control=False,  # no pidbox fanout binding left in the database
    beat_schedule={
        ENTRY: {"task": "beat_tick",
                "schedule": float(os.environ.get("LEASE_TEST_BEAT_INTERVAL", "1")),
                "kwargs": {"entry": ENTRY, "slot": SLOT}},
    },
)

_redis: redis.Redis | None = None


def record(event: str, **fields: Any) -> None:
    global _redis
    if _redis is None:
        _redis = redis.Redis.from_url(BROKER)
    _redis.rpush(JOURNAL, json.dumps({"event": event, "pid": os.getpid(), "t": time.time(),
                                      **fields}, default=str))


@app.task(base=LeasedTask, bind=True, name="beat_tick")
def tick(self: LeasedTask, entry: str, slot: str) -> None:
    """One run of the periodic entry: journal the slot from its argument and its header."""
    header = request_slot(self.request)
    record("run", entry=entry, slot=slot, header=header.isoformat() if header else None,
           task_id=self.request.id)


@signals.after_task_publish.connect
def _sent(sender: Any = None, headers: Any = None, body: Any = None, **_: Any) -> None:
    # What each beat really published, under which id (not the worker's own re-publishes of
    # deferred duplicates: only processes started as beats have LEASE_TEST_BEAT_ROLE=beat).
    # After the publish: the test stops a beat right after its last send, and a copy noted
    # before its publish may never have reached the broker.
    if sender == "beat_tick" and headers is not None and ROLE == "beat":
        kwargs = body[1] if isinstance(body, (list, tuple)) and len(body) > 1 else {}
        record("sent", entry=kwargs.get("entry"), slot=kwargs.get("slot"),
               header=headers.get("lease_slot"), task_id=headers.get("id"))


def _outcome(name: str) -> Any:
    def receiver(sender: Any = None, key: str | None = None, **_: Any) -> None:
        record(name, task_id=key)  # the key is the task id (no lease_key)
    return receiver


# A copy dropped because its slot already ran, or one that completed a slot whose owner died
# settling it (the body does not run): with the runs, one outcome per copy sent, so the test
# knows when every copy has been judged.
lease_signals.duplicate_ignored.connect(_outcome("ignored"), weak=False)
lease_signals.settle_completed.connect(_outcome("completed"), weak=False)


@signals.worker_ready.connect
def _ready(sender: Any = None, **_: Any) -> None:
    record("worker_ready", hostname=sender.hostname if sender is not None else None)
