"""A row from the moment of publish (``lease_record_at_publish``): a message the broker loses
before anyone claimed it is not lost for good.

A task has no row until its first claim, so the sweeper cannot re-publish what it never saw:
kombu's Redis transport pops a message before it records it as unacked (a worker killed in
between loses it), a publisher can die between its commit and its publish, and a broker
failover or a purged queue drops messages. With ``lease_record_at_publish = True`` (a task
option, the Celery setting, or per call: ``apply_async(..., lease_record=True)``) the
publisher writes the key's row as ``ready``, with the message's task info, *before* the
message goes to the broker: one conditional write (``Store.record_published``) that leaves an
existing row alone. Nobody claims a lost message's row, so the sweeper re-publishes it
``lease_sweep_grace`` seconds after it became claimable (after its countdown), as any ready
row; a message that was only waiting behind a long queue is not re-published while that queue
still holds messages (``worker/sweeper.py``), and if it is, the lease dedups the copy.

With ``lease_unique`` too, the write *is* the uniqueness check: of two publishers at once,
exactly one writes the row and publishes; the other finds the row and gets the holder's
``AsyncResult`` (the race that a read-then-publish leaves open, ``unique.py``).

What it does not cover: a publish whose row exists already (a live or done key) gets no row
of its own, so if that message is lost, its own ``AsyncResult`` waits (the key's work itself
is covered by the existing row).
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from celery.utils.time import maybe_make_aware

from ..keys import resolve_key
from ..stores.registry import shared_store

__all__ = ["countdown_of", "published_info", "record_at_publish"]

logger = logging.getLogger(__name__)

#: Publish options that say *when* the message runs: the row's sweep waits for them, and a
#: re-publish (after that moment) leaves them out.
_WHEN = ("countdown", "eta")


def countdown_of(app: Any, options: Mapping[str, Any]) -> float:
    """Seconds until the message may run: its ``countdown``, or its ``eta`` from now (a naive
    ``eta`` in the app's timezone, as Celery reads it)."""
    countdown = options.get("countdown")
    if countdown is not None:
        return max(float(countdown), 0.0)
    eta = options.get("eta")
    if isinstance(eta, str):
        eta = datetime.datetime.fromisoformat(eta)
    if not isinstance(eta, datetime.datetime):
        return 0.0
    eta = maybe_make_aware(eta, app.timezone)
    return max(float((eta - app.now()).total_seconds()), 0.0)


def published_info(task: Any, args: Sequence[Any] | None, kwargs: Mapping[str, Any] | None,
                   task_id: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """The message about to be published as a signature (task, args, kwargs, id, routing,
    links), the form the lease row keeps for a re-publish (``delivery.task_info``)."""
    kept = {k: v for k, v in options.items() if v is not None and k not in _WHEN}
    signature = dict(task.signature(tuple(args or ()), dict(kwargs or {}), task_id=task_id,
                                    **kept))
    signature["options"] = {k: v for k, v in signature.get("options", {}).items()
                            if v is not None}
    return signature


def record_at_publish(task: Any, args: Sequence[Any] | None, kwargs: Mapping[str, Any] | None,
                      task_id: str, options: Mapping[str, Any]) -> bool:
    """Write the row of the key these arguments name as ``ready`` with the message's task
    info; return whether it was written (False: the key has a row, left alone). A bad key
    fails here, at publish, with the error the worker would raise."""
    key = resolve_key(task.lease_key, task.run, tuple(args or ()), dict(kwargs or {}),
                      task_id=task_id)
    store = shared_store(task.lease_settings.store_url)
    written = store.record_published(
        key, task=published_info(task, args, kwargs, task_id, options),
        countdown=countdown_of(task.app, options))
    if not written:
        logger.debug("lease %s has a row already: task %s published without one of its own",
                     key, task_id)
    return written
