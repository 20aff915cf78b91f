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

A publish that raises takes its row back (the caller saw the failure and may publish again);
a message a worker drops unrun, revoked or expired, takes its row with it (``install``: Celery's
``task_revoked``), and a relative ``expires`` is recorded as the instant it names, so a
re-published copy expires when the original would have.

What it does not cover: a publish whose row exists already (a live or done key) gets no row
of its own, so if that message is lost, its own ``AsyncResult`` waits (the key's work itself
is covered by the existing row).
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from celery import signals as celery_signals
from celery.utils.time import maybe_make_aware
from kombu.entity import Exchange, Queue

from ..apps import is_leased
from ..errors import LeaseError
from ..keys import message_key
from ..models import LeaseState
from ..stores.registry import shared_store

__all__ = ["countdown_of", "install", "published_info", "record_at_publish", "withdraw"]

logger = logging.getLogger(__name__)

#: Publish options that say *when* the message runs: the row's sweep waits for them, and a
#: re-publish (after that moment) leaves them out.
_WHEN = ("countdown", "eta")
#: Publish options that are the publisher's machinery, not the message (Celery's canvas
#: passes a producer to every member of a group): never recorded.
_MACHINERY = ("producer", "connection", "publisher", "router", "add_to_parent")


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
    links), the form the lease row keeps for a re-publish (``delivery.task_info``): a queue or
    exchange by its name, a relative ``expires`` as the instant it names."""
    kept: dict[str, Any] = {}
    for name, value in options.items():
        if value is None or name in _WHEN or name in _MACHINERY:
            continue
        if isinstance(value, (Queue, Exchange)):
            value = value.name
        elif name == "expires" and isinstance(value, (int, float)):
            value = task.app.now() + datetime.timedelta(seconds=value)
        kept[name] = value
    signature = dict(task.signature(tuple(args or ()), dict(kwargs or {}), task_id=task_id,
                                    **kept))
    signature["options"] = {k: v for k, v in signature.get("options", {}).items()
                            if v is not None}
    return signature


def record_at_publish(task: Any, args: Sequence[Any] | None, kwargs: Mapping[str, Any] | None,
                      task_id: str, options: Mapping[str, Any]) -> str | None:
    """Write the row of the key these arguments name as ``ready`` with the message's task
    info; return the key if it was written (None: the key has a row, left alone). A bad key
    fails here, at publish, with the error the worker would raise."""
    key = message_key(task, args, kwargs, task_id)
    store = shared_store(task.lease_settings.store_url)
    written = store.record_published(
        key, task=published_info(task, args, kwargs, task_id, options),
        countdown=countdown_of(task.app, options))
    if not written:
        logger.debug("lease %s has a row already: task %s published without one of its own",
                     key, task_id)
        return None
    return key


def withdraw(task: Any, key: str, task_id: str, why: str) -> bool:
    """Delete the row ``record_at_publish`` wrote for ``task_id`` if nobody claimed it yet
    (its message failed to publish, or a worker dropped it unrun); return whether it was."""
    store = shared_store(task.lease_settings.store_url)
    record = store.get(key)
    if (record is None or record.state is not LeaseState.READY or record.attempts
            or record.task_id != task_id):
        return False
    purged = store.purge(key)
    if purged:
        logger.info("lease %s: the row written at the publish of task %s is withdrawn: %s",
                    key, task_id, why)
    return purged


def _drop_unrun(sender: Any = None, request: Any = None, expired: bool = False,
                **_: Any) -> None:
    """A worker dropped a message unrun (revoked, or expired): its row goes too, or the
    sweeper would publish it again, and again."""
    if not is_leased(sender) or request is None or not getattr(request, "id", None):
        return
    try:
        key = message_key(sender, getattr(request, "args", None), getattr(request, "kwargs", None),
                   request.id)
        withdraw(sender, key, request.id, "its message expired unrun" if expired
                 else "its message was revoked unrun")
    except (LeaseError, ValueError):
        logger.warning("lease_celery: the row of revoked task %s could not be withdrawn",
                       getattr(request, "id", None), exc_info=True)


def install() -> None:
    """Withdraw the row of a message a worker drops unrun (wiring)."""
    celery_signals.task_revoked.connect(
        _drop_unrun, weak=False, dispatch_uid="lease_celery.execution.published.task_revoked")
