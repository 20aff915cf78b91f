"""The end of ``chaos.job`` in the ``django-tx`` variant, in the worker processes: Django set
up with the run's project (:mod:`.djapp`), the job a ``LeasedDjangoTask``, and its models
written with the key's finish in one ``self.lease.atomic()`` block.

The block, as a Django app writes it::

    with self.lease.atomic() as tx:
        order = Order.objects.create(job=job, token=self.lease.token, ...)
        with transaction.atomic():           # a savepoint, as apps nest their blocks
            Payment.objects.create(order=order, token=self.lease.token)
        tx.complete(result)

A Django connection the ``conn`` fault broke (Django's ``OperationalError`` or
``InterfaceError``, from the ORM's statements, the lease's own in the block, or the commit) is
closed and the block run again, with the ``commit_exit`` fault after it: the app-tx body's
loop (:func:`.apptx.commit_retrying`). Imported only when the variant is ``django-tx``.
"""

from __future__ import annotations

import os
from typing import Any

from .apptx import commit_retrying
from .events import EventLog
from .flags import Flags

__all__ = ["SETTINGS", "complete_in_django", "job_base", "setup_django"]

SETTINGS = "benchmarks.chaos.djapp.settings"


def setup_django() -> None:
    """Django configured for this worker process, before its Celery app is made: Celery's
    Django fix-up (closing connections around tasks and after the pool forks) follows
    ``DJANGO_SETTINGS_MODULE``, which must be the run's project whatever the environment had
    (the Django tests set their own)."""
    os.environ["DJANGO_SETTINGS_MODULE"] = SETTINGS
    import django

    django.setup()


def job_base() -> type[Any]:
    """The job's task class: ``LeasedTask`` with Celery's ``DjangoTask`` and
    ``self.lease.atomic()``."""
    from lease_celery.contrib.django.task import LeasedDjangoTask

    return LeasedDjangoTask


def complete_in_django(task: Any, job: str, result: dict[str, Any], *, events: EventLog,
                       flags: Flags) -> dict[str, Any]:
    """Write the job's order and payment and complete the key with ``result``, together."""
    from django.db import InterfaceError, OperationalError, connection, transaction

    from .djapp.models import Order, Payment

    lease = task.lease

    def commit() -> None:
        with lease.atomic() as tx:
            order = Order.objects.create(job=job, token=lease.token, pid=os.getpid(),
                                         task_id=task.request.id)
            with transaction.atomic():
                Payment.objects.create(order=order, token=lease.token)
            tx.complete(result)

    commit_retrying(task, commit, errors=(OperationalError, InterfaceError),
                    drop=connection.close, connection="django", events=events, flags=flags)
    return result
