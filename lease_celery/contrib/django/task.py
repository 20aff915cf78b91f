"""``LeasedTask`` with Celery's ``DjangoTask``: the lease gate, and ``delay_on_commit`` /
``apply_async_on_commit`` (published once the caller's transaction commits)."""

from __future__ import annotations

from celery.contrib.django.task import DjangoTask

from ...task import LeasedTask

__all__ = ["LeasedDjangoTask"]


class LeasedDjangoTask(LeasedTask, DjangoTask):
    """``@app.task(base=LeasedDjangoTask, bind=True, lease_key="order:{order_id}")``.

    ``LeasedTask`` first: its ``__call__`` is the gate; ``DjangoTask`` adds only the
    on-commit publishing methods."""
