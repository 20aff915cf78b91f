"""The shop's leased task: pay an order exactly once, under duplicates, stalls and kills.

The payment and the order's paid token are written in the lease's fenced transaction, on the
store's connection to the project's database: they commit only if this execution still holds
the order's lease. Events go to a Redis journal the tests read (LEASE_TEST_JOURNAL).
"""

from __future__ import annotations

import json
import os
import socket
import time
from typing import Any

import redis
from celery import shared_task, signals
from django.db import connections

from lease_celery.contrib.django.task import LeasedDjangoTask

from .models import Order

JOURNAL = os.environ.get("LEASE_TEST_JOURNAL", "journal")
BROKER = os.environ.get("LEASE_TEST_BROKER", "redis://127.0.0.1:6379/11")
ALIAS = os.environ.get("LEASE_TEST_STORE", "django://default").removeprefix("django://")


def record(event: str, **fields: Any) -> None:
    entry = {"event": event, "pid": os.getpid(), "host": socket.gethostname(),
             "t": time.time(), **fields}
    redis.Redis.from_url(BROKER).rpush(JOURNAL, json.dumps(entry, default=str))


@signals.worker_ready.connect
def _ready(sender: Any = None, **_: Any) -> None:
    record("worker_ready", hostname=sender.hostname if sender is not None else None)


@shared_task(base=LeasedDjangoTask, bind=True, lease_key="order:{order_id}", name="pay_order")
def pay_order(self: LeasedDjangoTask, order_id: int, stall: float = 0.0) -> dict[str, Any]:
    token = self.lease.token
    # The ORM through Django's own connection of this worker thread: a read.
    order = Order.objects.using(ALIAS).get(pk=order_id)
    record("started", order=order_id, token=token, stall=stall)
    if stall:
        time.sleep(stall)  # the stalled worker: its lease expires, another takes the key over
    mark = "?" if connections[ALIAS].vendor == "sqlite" else "%s"
    try:
        with self.lease.fenced() as conn:
            conn.execute("INSERT INTO shop_payment (order_id, token, worker) "
                         f"VALUES ({mark}, {mark}, {mark})",
                         (order.pk, token, f"{socket.gethostname()}:{os.getpid()}"))
            conn.execute(f"UPDATE shop_order SET paid_token = {mark} WHERE id = {mark}",
                         (token, order.pk))
    except Exception as exc:
        record("refused", order=order_id, token=token, error=type(exc).__name__)
        raise
    record("paid", order=order_id, token=token)
    return {"order": order_id, "token": token}


@shared_task(base=LeasedDjangoTask, bind=True, lease_key="note:{number}", name="note_order")
def note_order(self: LeasedDjangoTask, number: str) -> str:
    """Published with delay_on_commit by the tests: runs once the order's row is committed."""
    order = Order.objects.using(ALIAS).get(number=number)
    record("noted", number=number, order=order.pk, token=self.lease.token)
    return number
