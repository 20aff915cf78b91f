"""The shop's leased tasks: pay an order exactly once, under duplicates, stalls and kills.

``pay_order`` writes the payment and the order with the ORM inside ``self.lease.atomic()``:
the rows and the key's finish commit together, or roll back together when this execution
no longer holds the order's lease. Events go to a Redis journal the tests read
(LEASE_TEST_JOURNAL).
"""

from __future__ import annotations

import json
import os
import socket
import time
from typing import Any

import redis
from celery import shared_task, signals

from lease_celery.contrib.django.task import LeasedDjangoTask

from .models import Order, Payment

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
    record("started", order=order_id, token=token, stall=stall)
    if stall:
        time.sleep(stall)  # the stalled worker: its lease expires, another takes the key over
    try:
        with self.lease.atomic() as tx:
            order = Order.objects.using(ALIAS).select_for_update().get(pk=order_id)
            Payment.objects.using(ALIAS).create(order=order, token=token,
                                                worker=f"{socket.gethostname()}:{os.getpid()}")
            order.paid_token = token
            order.save(using=ALIAS, update_fields=["paid_token"])
            result = tx.complete({"order": order_id, "token": token})
    except Exception as exc:
        record("refused", order=order_id, token=token, error=type(exc).__name__)
        raise
    record("paid", order=order_id, token=token, driver=_driver())
    return result


def _driver() -> str:
    """The driver of Django's connection in this process (what the tests mean to cover)."""
    from django.db import connections

    return type(connections[ALIAS].connection).__module__.split(".")[0]


@shared_task(base=LeasedDjangoTask, bind=True, lease_key="note:{number}", name="note_order")
def note_order(self: LeasedDjangoTask, number: str) -> str:
    """Published with delay_on_commit: runs once the order's row is committed."""
    order = Order.objects.using(ALIAS).get(number=number)
    record("noted", number=number, order=order.pk, token=self.lease.token)
    return number
