"""``LeasedTask`` with Celery's ``DjangoTask``: the lease gate, ``self.lease.atomic()`` and an
outbox-backed ``delay_on_commit`` / ``apply_async_on_commit``."""

from __future__ import annotations

import weakref
from typing import Any

from celery.contrib.django.task import DjangoTask

from ...errors import LeaseError
from ...execution.outbox import publish_committed
from ...runtime.execution import Execution
from ...task import LeasedTask
from .transactions import DjangoConnection, DjangoLease, alias_of

__all__ = ["LeasedDjangoTask"]

#: Each execution's DjangoLease (the handle keeps what it read, as the plain one does).
_HANDLES: weakref.WeakKeyDictionary[Execution, DjangoLease] = weakref.WeakKeyDictionary()


class LeasedDjangoTask(LeasedTask, DjangoTask):
    """``@app.task(base=LeasedDjangoTask, bind=True, lease_key="order:{order_id}")``.

    ``LeasedTask`` first: its ``__call__`` is the gate. ``self.lease`` has ``atomic()``
    (the ORM's writes and the finish in one transaction). ``delay_on_commit`` and
    ``apply_async_on_commit`` write the key's row in the caller's ``atomic()`` block and
    publish once it commits; a publish that never happened (the process died right after
    the commit) is done from the row by the workers' sweeper. Celery's own versions only
    publish on commit, and lose the task when the process dies in between.
    """

    @property
    def lease(self) -> DjangoLease:
        execution = getattr(self.request, "lease", None)
        if not isinstance(execution, Execution):
            raise LeaseError("self.lease is only available inside a LeasedTask body")
        handle = _HANDLES.get(execution)
        if handle is None:
            handle = _HANDLES[execution] = DjangoLease(execution)
        return handle

    def delay_on_commit(self, *args: Any, **kwargs: Any) -> Any:
        """``delay`` once the caller's transaction commits, its row written in it."""
        return self.apply_async_on_commit(args, kwargs)

    def apply_async_on_commit(self, args: Any = None, kwargs: Any = None, *,
                              using: str | None = None, **options: Any) -> Any:
        """``apply_async`` once the transaction of ``using`` (default: the store's alias)
        commits; the key's row is written in that transaction (the outbox). Outside an
        ``atomic()`` block it publishes at once, as Celery's does. Returns the task's
        ``AsyncResult`` (its id is fixed now)."""
        from django.db import transaction

        alias = using or alias_of(self.lease_settings.store_url)
        conn = DjangoConnection(alias)
        if not conn.in_transaction:
            return self.apply_async(args, kwargs, **options)
        result = self.apply_async(args, kwargs, lease_transaction=conn, **options)
        # publish_committed takes every message held for this connection: several enqueues in
        # one block are published by the first hook, the others find nothing left.
        transaction.on_commit(lambda: publish_committed(conn), using=alias)
        return result
