"""Unique at enqueue (``lease_unique``): don't publish work whose key already has a holder.

celery-singleton users expect ``apply_async`` to hand back the running task instead of queueing
the same work again. With ``lease_unique=True`` (a task option, or per call:
``task.apply_async(args, lease_unique=True)``) the publisher reads the key's lease row first,
one store read: if a delivery holds the key (``running``), waits for a retry (``ready``), or
finished it (``done``), the ``AsyncResult`` of that delivery's task id is returned and nothing
is published. Otherwise (no row, ``dead``, or a row that kept no task id) the task is published
as usual.

This saves a message; it is not what makes the work run once. Two publishers reading at the
same instant both publish, and a message still waiting in the queue has no row yet: those
duplicates meet the lease when they run, and the later one is answered with the accepted
outcome (``lease_celery.execution.answers``). lease_celery's own re-publishes (a deferred
duplicate, the sweeper, ``requeue``) pass ``lease_unique=False``: they carry a delivery that
must arrive.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from ..keys import message_key
from ..models import LeaseState
from ..stores.registry import shared_store

__all__ = ["UNIQUE_STATES", "existing_holder"]

logger = logging.getLogger(__name__)

#: The states in which a key's holder stands for the work: live, waiting to retry, or done.
UNIQUE_STATES = frozenset({LeaseState.RUNNING, LeaseState.READY, LeaseState.DONE})


def existing_holder(task: Any, args: Sequence[Any] | None, kwargs: Mapping[str, Any] | None,
                    task_id: str | None) -> Any:
    """The ``AsyncResult`` of the delivery holding ``task``'s key for these arguments, or
    None when the task should be published. A bad key fails here, at publish, with the error
    the worker would raise."""
    if task.lease_key is None and not task_id:
        return None  # keyed by a task id yet to be made: nothing can hold it
    key = message_key(task, args, kwargs, task_id)
    record = shared_store(task.lease_settings.store_url).get(key)
    if record is None or record.state not in UNIQUE_STATES or not record.task_id:
        return None
    if record.task_id == task_id:
        return None  # the holder publishing itself again (Celery's retry): let it
    logger.info("lease %s is %s under task %s: not published again (lease_unique)", key,
                record.state.value, record.task_id)
    return task.AsyncResult(record.task_id)
