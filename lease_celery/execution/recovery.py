"""Recovered work goes ahead of new work: the priority a recovery is re-published with.

Work the library publishes again because it was already due goes to the tail of its queue
without this, and a queue with a backlog holds it there behind everything published since (a
chaos run of 1,000 tasks at ttl 2 s: a stalled owner's key settled a median of 33-44 s after
the fault). That is the sweeper's re-publish (its owner died or stalled, its message was lost,
its settle was left unfinished), the time-limit handler's, and a delivery's own deferral when
its lease lapsed under it or its store did not answer. They are re-published with the broker's
own priority, ``lease_recovery_priority`` (``"auto"`` by default):

- RabbitMQ (amqp): the queue's ``x-max-priority`` (Celery's ``task_queue_max_priority``, or
  the queue's own argument): higher goes first. Without one, priorities do nothing.
- Redis: kombu pops a queue's priority lists in step order, lowest number first, so recovery
  takes the first step (0). New work is at 0 too, unless it is published at a later step
  (``task_default_priority = 5`` with kombu's default steps 0, 3, 6, 9).
- other transports (SQS, the filesystem): none; recovered work waits its turn.

``doctor`` says which setting is missing. Deferred duplicates of a live key are not recovered
work: they go back at the priority their work was first published with (kept in the header
``lease_priority`` of a recovered copy), so they keep waiting at the tail.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Mapping
from typing import Any

from ..settings import recovery_priority_setting

__all__ = ["FIRST_PRIORITY_HEADER", "broker_family", "first_priority", "queue_max_priority",
           "queue_of", "recovery_options", "recovery_priority", "redis_list"]

logger = logging.getLogger(__name__)

#: Header of a recovered copy: the priority its work was first published with ("" for none).
FIRST_PRIORITY_HEADER = "lease_priority"

#: kombu's driver types whose priorities behave alike.
_FAMILIES = {"redis": "redis", "amqp": "amqp", "librabbitmq": "amqp"}


def broker_family(app: Any) -> str:
    """``redis``, ``amqp``, or the transport's own driver type (``sqs``, ``filesystem``...):
    what kombu loads for the app's broker (no connection is made)."""
    driver = str(getattr(app.connection_for_write().transport, "driver_type", "") or "")
    return _FAMILIES.get(driver, driver)


def queue_of(app: Any, info: Mapping[str, Any]) -> Any:
    """The kombu ``Queue`` a recorded delivery (a signature as a dict) is routed to, or None
    when its routing cannot be worked out here."""
    try:
        options = dict(info.get("options") or {})
        return app.amqp.router.route(options, info.get("task"), info.get("args"),
                                     info.get("kwargs"))["queue"]
    except Exception:
        logger.debug("lease_celery: no queue for task %r", info.get("task"), exc_info=True)
        return None


def _redis_steps(app: Any) -> list[int]:
    from kombu.transport.redis import PRIORITY_STEPS

    steps = (app.conf.broker_transport_options or {}).get("priority_steps") or PRIORITY_STEPS
    return sorted(int(step) for step in steps)


def redis_list(app: Any, priority: int | None) -> int:
    """Which of kombu's Redis priority lists a message of ``priority`` goes to (its step; a
    message without a priority goes to the first), as ``kombu.transport.redis`` computes it."""
    steps = _redis_steps(app)
    number = min(max(int(priority or 0), 0), 9)  # kombu bounds message priorities to 0-9
    return steps[max(bisect.bisect(steps, number) - 1, 0)]


def queue_max_priority(app: Any, queue: Any) -> int | None:
    """The ``x-max-priority`` RabbitMQ orders ``queue`` (a kombu Queue) by, or None: the
    queue's own argument, else Celery's ``task_queue_max_priority``."""
    arguments = getattr(queue, "queue_arguments", None) or {}
    value = arguments.get("x-max-priority") or app.conf.task_queue_max_priority
    return int(value) if value else None


def recovery_priority(app: Any, info: Mapping[str, Any]) -> int | None:
    """The priority recovered work of ``info`` (a delivery as a signature dict) is re-published
    with, or None where the broker gives it none (then it keeps its own)."""
    setting = recovery_priority_setting(app)
    if setting != "auto":
        return setting if isinstance(setting, int) else None
    family = broker_family(app)
    if family == "redis":
        return _redis_steps(app)[0]
    if family == "amqp":
        return queue_max_priority(app, queue_of(app, info))
    return None


def recovery_options(app: Any, info: Mapping[str, Any]) -> dict[str, Any]:
    """The ``priority`` and ``headers`` options that send ``info`` again as recovered work
    (none where the broker gives it no priority). The header keeps the priority the work was
    first published with, once: a copy of a copy still knows it."""
    priority = recovery_priority(app, info)
    if priority is None:
        return {}
    options = info.get("options") or {}
    headers = dict(options.get("headers") or {})
    if FIRST_PRIORITY_HEADER not in headers:
        first = options.get("priority")
        headers[FIRST_PRIORITY_HEADER] = "" if first is None else first
    return {"priority": priority, "headers": headers}


def first_priority(headers: Mapping[str, Any] | None) -> tuple[bool, int | None]:
    """(whether ``headers`` are a recovered copy's, the priority its work was first published
    with: None for the task's default)."""
    if not headers or FIRST_PRIORITY_HEADER not in headers:
        return False, None
    value = headers[FIRST_PRIORITY_HEADER]
    return True, (int(value) if isinstance(value, int) and not isinstance(value, bool)
                  else None)
