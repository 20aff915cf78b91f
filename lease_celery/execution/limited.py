"""Key-group limits in a delivery: which group it counts in, what a refusal does with it, and
the hand-on after a slot frees (the rules themselves: ``lease_celery.limits`` and
``Store.claim_limited``).

A delivery over the limit is parked: the store keeps it as the group's waiter, with its task
info, and the message is acked (``Ignore``), so it holds no pool process and is not
re-published on a timer. The worker whose finish, release or death freed a slot publishes the
next waiters again right after its write (``hand_on``); the sweeper does it for a holder that
died (its slot frees by expiring), and ``celery leases limit`` after raising a limit. A
delivery over the rate is deferred to the group's next allowed start.
"""

from __future__ import annotations

import logging
import random
from typing import Any

from .. import signals
from ..errors import LeaseError
from ..keys import resolve_key
from ..limits import GroupLimit, LimitRefused, Waiter
from ..settings import LeaseSettings, sweep_grace
from ..stores.base import Store
from .delivery import republish

__all__ = ["describe", "group_of", "hand_on", "note_wait", "publish_waiters",
           "refusal_delay"]

logger = logging.getLogger(__name__)


def group_of(task: Any, settings: LeaseSettings, args: Any, kwargs: Any) -> GroupLimit | None:
    """The group limit this delivery is claimed under (None: the task is not limited). The
    group is ``lease_limit_key`` resolved over the arguments, or the task's name."""
    if settings.limit is None and settings.rate is None:
        return None
    spec = settings.limit_key
    group = task.name if spec is None else resolve_key(
        spec, task.run, args, kwargs, task_id=None, name="lease_limit_key")
    return GroupLimit(group, settings.limit, settings.rate)


def refusal_delay(refusal: LimitRefused, settings: LeaseSettings, now: float) -> float:
    """Seconds until a refused delivery that is not parked tries again: the group's next
    allowed start, spread over one interval (deliveries deferred together do not all come
    back in one instant); a full group's, a heartbeat interval."""
    if refusal.retry_at is not None:
        interval = settings.rate.interval if settings.rate is not None else 0.0
        return max(refusal.retry_at - now, 0.0) + random.uniform(0, interval)
    return settings.heartbeat_interval


def describe(refusal: LimitRefused) -> str:
    if refusal.reason == "rate":
        return f"limit group {refusal.group!r} is at its rate"
    return (f"limit group {refusal.group!r} is full ({refusal.running} running of "
            f"{refusal.limit}, {refusal.waiting} waiting)")


def note_wait(task: Any, key: str, refusal: LimitRefused) -> None:
    """A parked delivery: logged, and ``limit_wait`` sent (metrics, OpenTelemetry)."""
    logger.info("delivery %s of %s waits: %s", task.request.id, key, describe(refusal))
    signals.limit_wait.send(sender=task, key=key, group=refusal.group, refusal=refusal)


def hand_on(task: Any, store: Store, group: str | None) -> list[Waiter]:
    """A slot of ``group`` freed (this worker's finish, release or death of a limited key):
    publish the next waiters again. A failure is logged, not raised: the sweeper hands them
    on a grace period later."""
    if group is None:
        return []
    try:
        waiters = store.hand_on(group, grace=sweep_grace(task.app))
    except LeaseError as exc:
        logger.warning("limit group %r: could not hand the slot on (%s); the sweeper will",
                       group, exc)
        return []
    return publish_waiters(task.app, waiters)


def publish_waiters(app: Any, waiters: list[Waiter], **options: Any) -> list[Waiter]:
    """Publish each waiter's recorded delivery again; the ones published."""
    published = []
    for waiter in waiters:
        if waiter.task is None:
            continue
        try:
            republish(app, waiter.task, **options)
        except Exception as exc:  # one waiter must not keep back the others
            logger.warning("limit group %r: waiter %s could not be published (%r); handed on "
                           "again a grace period later", waiter.group, waiter.key, exc)
            continue
        logger.info("limit group %r: waiter %s handed on (task %s)", waiter.group,
                    waiter.key, (waiter.task.get("options") or {}).get("task_id"))
        signals.limit_handed_on.send(sender=app, key=waiter.key, group=waiter.group,
                                     waiter=waiter)
        published.append(waiter)
    return published
