"""What the three examples share: a Celery app whose lease store lives in the app's own
database, a worker in this process, and the story they tell.

The story: three orders are placed, each in a transaction that writes the order and enqueues
its payment (``apply_async(..., lease_transaction=...)``); the third transaction rolls back.
Order 1's payment is asked for twice: the second request is answered with the first's
outcome. Each payment task writes its payment row and the key's finish in one commit
(``self.lease.transaction``). At the end every committed order is paid exactly once, and the
rolled-back order never existed for the worker either.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from celery import Celery
from celery.contrib.testing.worker import start_worker

from lease_celery import open_store

ORDERS = [(1, 30), (2, 45), (3, 99)]  # (order id, amount); order 3's transaction rolls back


class Rollback(Exception):
    """Raised inside order 3's transaction: the customer cancelled before it committed."""


def make_app(name: str, store_url: str) -> Celery:
    """An app on an in-process broker (the examples need no broker server), its lease store
    at ``store_url``: the same database as the app's tables."""
    app = Celery(name, broker="memory://", backend="cache+memory://", set_as_current=False)
    app.conf.update(lease_store_url=store_url, task_acks_late=True,
                    worker_hijack_root_logger=False)
    return app


@contextmanager
def worker(app: Celery) -> Iterator[None]:
    """A real Celery worker consuming the app's queue, in a thread of this process. The lease
    store makes its tables first (as a worker's start does, or `celery leases doctor`): the
    app's transactions write into them."""
    with open_store(app.conf.lease_store_url) as store:
        store.stats()
    with start_worker(app, pool="solo", perform_ping_check=False, shutdown_timeout=30):
        yield


def tell(place_order: Callable[[int, int, bool], Any], pay: Any,
         paid: Callable[[], list[tuple[int, int]]]) -> list[tuple[int, int]]:
    """Place the orders (the last one rolled back), deliver the first payment twice, wait
    for the payments, and return ``(order id, payments)`` for every order in the database."""
    results = []
    for order_id, amount in ORDERS:
        try:
            results.append(place_order(order_id, amount, order_id == 3))
        except Rollback:
            print(f"order {order_id}: rolled back before commit, its payment never queued")
    duplicate = pay.apply_async((1,))  # order 1 paid again: answered, not run
    for result in [*results, duplicate]:
        print(f"payment {result.id[:8]}: {result.get(timeout=30)}")
    rows = paid()
    for order_id, payments in rows:
        print(f"order {order_id}: {payments} payment(s)")
    return rows
