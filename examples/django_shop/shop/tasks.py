"""The leased task that pays an order: its model writes and its finish in one transaction."""

from __future__ import annotations

import os
import socket
import time
from typing import Any

from celery import shared_task

from lease_celery.contrib.django.task import LeasedDjangoTask

from .models import Attempt, Order, Payment


@shared_task(base=LeasedDjangoTask, bind=True, lease_key="pay:{order_id}")
def pay_order(self: LeasedDjangoTask, order_id: int, work: float = 0.5) -> dict[str, Any]:
    token = self.lease.token
    Attempt.objects.create(order_id=order_id, token=token, pid=os.getpid(), outcome="started")
    time.sleep(work)  # talking to the payment provider (a stall or a kill lands here)
    try:
        # The payment, the order and the key's finish commit together, or not at all: a
        # worker that lost the lease while it was away rolls back with LeaseLost.
        with self.lease.atomic() as tx:
            order = Order.objects.select_for_update().get(pk=order_id)
            Payment.objects.create(order=order, token=token,
                                   worker=f"{socket.gethostname()}:{os.getpid()}")
            order.paid_token = token
            order.save(update_fields=["paid_token"])
            result = tx.complete({"order": order.number, "token": token})
    except Exception as exc:
        Attempt.objects.create(order_id=order_id, token=token, pid=os.getpid(),
                               outcome=f"refused: {type(exc).__name__}")
        raise
    Attempt.objects.create(order_id=order_id, token=token, pid=os.getpid(), outcome="paid")
    return result
