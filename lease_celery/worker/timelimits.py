"""Celery's hard time limit, told to the lease row by the worker's main process.

A hard time limit is enforced by the pool in the worker's main process: it stores FAILURE
(TimeLimitExceeded), acks the message (``acks_on_failure_or_timeout``), sends ``task_failure``
and only then terminates the child. The child cannot tell that SIGTERM from a shutdown's, so
the main process, which knows, ends the key here: ``dead`` with a reason naming the limit, so
the row tells the result backend's story, and the sweeper does not run it again. With
``lease_retry_time_limits`` the key is released and re-published instead. The soft limit is
raised inside the body and handled by ``LeasedTask`` itself.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from celery import signals as celery_signals
from celery.exceptions import TimeLimitExceeded

from ..apps import is_leased
from ..errors import LeaseError
from ..execution.answers import stored_failure
from ..execution.completion import Completion
from ..execution.delivery import republish
from ..keys import resolve_key
from ..models import Lease, LeaseState
from ..runtime.execution import Execution
from ..stores.registry import shared_store

__all__ = ["end_after_hard_time_limit"]

logger = logging.getLogger(__name__)


def end_after_hard_time_limit(task: Any, task_id: str, args: Any, kwargs: Any,
                              exc: BaseException) -> bool:
    """End the running lease of ``task_id`` after Celery's hard time limit; True if done.

    The child is still running (the pool terminates it after ``task_failure``), so the row
    still names it; the write is fenced on that owner and token, and made by a completion of
    the child's lease like any other end (its verdict, its signals, its limit group handed
    on). The hold time it reports starts here: this process never held the lease.
    """
    settings = task.lease_settings
    key = resolve_key(task.lease_key, task.run, tuple(args or ()), dict(kwargs or {}),
                      task_id=task_id)
    store = shared_store(settings.store_url)
    record = store.get(key)
    if (record is None or record.state is not LeaseState.RUNNING or record.owner is None
            or record.task_id != task_id):
        return False
    lease = Lease(key, record.owner, record.token, record.expires_at or 0.0,
                  fence=record.fence, attempts=record.attempts, takeovers=record.takeovers)
    completion = Completion(task, Execution(lease, store=store, ttl=settings.ttl,
                                            heartbeat_interval=settings.heartbeat_interval,
                                            sent_at=time.monotonic(), task=task))
    limit = exc.args[0] if exc.args else "?"
    reason = f"hard time limit exceeded ({limit}s): {exc!r}"
    if not settings.retry_time_limits:
        return bool(completion.kill(reason, settle_within=None, error=stored_failure(exc)))
    ended = bool(completion.release(reason))
    if ended and record.task is not None:
        # As recovered work, ahead of new work; if this fails, the sweeper re-publishes it.
        republish(task.app, record.task, recovery=True)
    return ended


def _on_task_failure(sender: Any = None, task_id: str | None = None,
                     exception: BaseException | None = None, args: Any = None,
                     kwargs: Any = None, **_: Any) -> None:
    if (not is_leased(sender) or not isinstance(exception, TimeLimitExceeded)
            or task_id is None or getattr(sender.request, "lease", None) is not None):
        return  # not a hard limit told by the pool (a body raising it is handled there)
    try:
        end_after_hard_time_limit(sender, task_id, args, kwargs, exception)
    except LeaseError as exc:
        logger.warning("task %s: hard time limit not recorded on its lease (%s); the lease "
                       "expires and the sweeper runs it again", task_id, exc)


def install() -> None:
    """Record hard time limits the pool told on the lease (wiring)."""
    celery_signals.task_failure.connect(_on_task_failure, weak=False,
                                        dispatch_uid="lease_celery.worker.timelimits.task_failure")
