"""Finishing behind the return: a fire-and-forget task's finish, off the task's own path.

When Celery does nothing with a task's outcome (``ignore_result``, no callback, chain step or
chord: ``AttemptEnding._settle_within`` is None), nothing after the body waits for the
finish's verdict. Celery stores no result and sends nothing; the verdict changes only what the
row says. So the finish is queued on the heartbeat's sender threads and the pool process takes
its next task at once, a store round trip sooner (``lease_finish_in_background``; by default,
``"auto"``, only after a body that ran at least 2 ms: a no-op body pays more for the hand-off
to the thread than for the round trip).

What holds is what holds for a synchronous finish, judged by the same single conditional
write: one accepted outcome per key, and a stale owner's finish refused. The difference is
when the write lands, relative to Celery's ack (``acks_late``): possibly just after it. A
process killed in between leaves the key ``running``; its lease expires and the sweeper
re-publishes the task, which runs again, as it would after a crash just before a synchronous
finish. A write the store refuses, or cannot take, is left to the same path (no delivery is
re-published from here: the sweeper owns that).

The signals (``lease_finished``, ``stale_result_rejected``) fire from the sender thread with
the task's request pushed there, so receivers read ``sender.request`` as they would in the task.
"""

from __future__ import annotations

import logging
from typing import Any

from .. import signals
from ..checks import EncodedResult, encode_result
from ..errors import StoreError
from ..runtime.handle import LeaseHandle
from ..runtime.heartbeat import Heartbeat

__all__ = ["finish_in_background"]

logger = logging.getLogger(__name__)


def finish_in_background(task: Any, handle: LeaseHandle, result: Any,
                         heartbeat: Heartbeat) -> None:
    """Queue the finish of ``handle`` with ``result``; the caller returns the result to Celery.

    ``result`` is encoded here, in the task, so a result the store cannot hold fails the task
    as a synchronous finish would (``ResultNotSerializable``), before anything is queued.
    """
    encoded = EncodedResult(encode_result(result))
    request = task.request  # the delivery's own Context: Celery pops it, and never changes it

    def write() -> None:
        task.request_stack.push(request)
        try:
            _finish(task, handle, encoded, heartbeat)
        finally:
            task.request_stack.pop()

    heartbeat.in_background(handle, write)


def _finish(task: Any, handle: LeaseHandle, encoded: EncodedResult,
            heartbeat: Heartbeat) -> None:
    try:
        accepted = handle._store.finish(handle._lease, encoded)
    except StoreError as exc:
        logger.warning("lease %s token %s: finish failed in the lease store (%s); the key "
                       "stays running until its lease expires, then the sweeper re-publishes "
                       "the task", handle.key, handle.token, exc)
        return
    finally:
        heartbeat.unwatch(handle)
    if accepted:
        logger.info("lease %s token %s finished", handle.key, handle.token)
        signals.lease_finished.send(sender=task, key=handle.key, lease=handle._lease,
                                    hold_time=handle._held_for, duration=handle._body_duration)
        return
    reason = "finish refused: the lease expired or was taken over"
    handle._mark_lost(reason)
    taken = handle._taken_over()
    logger.warning("lease %s owner %s token %s: stale outcome rejected: %s%s", handle.key,
                   handle.owner, handle.token, reason,
                   "" if taken else "; nobody took the key over: the sweeper re-publishes it")
    signals.stale_result_rejected.send(sender=task, key=handle.key, lease=handle._lease,
                                       reason=reason, hold_time=handle._held_for)
