"""A Django process that enqueues ``note_order`` in the transactions that create orders
(``python -m tests.django_integration.project.shop.producer ALIAS COMMITTED ROLLED KILLED``):
one commits, one rolls back, and the last is killed (SIGKILL) right after its commit, before
the task is published. Prints the committed task's id."""

from __future__ import annotations

import os
import signal
import sys

import django


class _Boom(Exception):
    pass


def main(alias: str, committed: str, rolled_back: str, killed: str) -> None:
    django.setup()
    from django.db import transaction

    from tests.django_integration.project.celery_app import app  # noqa: F401  (the app)
    from tests.django_integration.project.shop.models import Order
    from tests.django_integration.project.shop.tasks import note_order

    with transaction.atomic(using=alias):
        Order.objects.using(alias).create(number=committed, amount=1)
        result = note_order.delay_on_commit(committed)
    print(result.id, flush=True)
    try:
        with transaction.atomic(using=alias):
            Order.objects.using(alias).create(number=rolled_back, amount=1)
            note_order.delay_on_commit(rolled_back)
            raise _Boom()
    except _Boom:
        pass
    with transaction.atomic(using=alias):
        Order.objects.using(alias).create(number=killed, amount=1)
        # Registered first, so it runs first once the block commits: the process dies
        # between the commit and the publish.
        transaction.on_commit(lambda: os.kill(os.getpid(), signal.SIGKILL), using=alias)
        note_order.delay_on_commit(killed)


if __name__ == "__main__":
    main(*sys.argv[1:5])
