"""Finishing behind the return: a fire-and-forget task's finish, off the task's own path.

When Celery does nothing with a task's outcome (``ignore_result``, no callback, chain step or
chord: ``Ending.settle_within`` is None), nothing after the body waits for the
finish's verdict. Celery stores no result and sends nothing; the verdict changes only what the
row says. So the finish is queued and the pool process takes its next task at once
(``lease_finish_in_background``, ``settings.LeaseSettings.finish_mode``), in one of two ways:

- *carried* (``"auto"``, the default, after a body shorter than 2 ms, on a store that makes it
  one transaction: ``Store.carries_finish``, all three): the next claim this process makes on
  the same store writes it, ``Store.finish_and_claim``, both in one transaction (SQLite: one
  commit and one fsync instead of two; PostgreSQL: one statement; Redis: one script), with no
  sender woken for it; only a finish no claim took within ``CARRY_WITHIN`` (the process went
  idle) is written by one of the heartbeat's sender threads. The round trip is saved, but the
  next claim is a little longer: it stays on the task's path (what it saves, measured through
  real workers: docs/proof.md, "The carried finish").
- *background* (``"auto"`` after a body of 2 ms or more, and ``True``): a sender thread writes
  it at once, off the path of the next task, at the price of the hand-off to the thread
  (which costs a short body more than the round trip it hides).

What holds is what holds for a synchronous finish, judged by the same single conditional
write: one accepted outcome per key, and a stale owner's finish refused. The difference is
when the write lands, relative to Celery's ack (``acks_late``): possibly just after it. A
process killed in between leaves the key ``running``; its lease expires and the sweeper
re-publishes the task, which runs again, as it would after a crash just before a synchronous
finish. A write the store refuses, or cannot take, is left to the same path (no delivery is
re-published from here: the sweeper owns that).

The signals (``lease_finished``, ``stale_result_rejected``) fire where the write was made (the
next claim's thread, or a sender) with the finished task's request pushed there, so receivers
read ``sender.request`` as they would in the task.
"""

from __future__ import annotations

import logging
from typing import Any

from ..checks import EncodedResult, encode_result
from ..errors import StoreError
from ..runtime.execution import Execution
from ..runtime.heartbeat import Heartbeat
from .completion import Completion

__all__ = ["CARRY_WITHIN", "CarriedFinish", "finish_in_background"]

logger = logging.getLogger(__name__)


#: Seconds a finish behind the return waits for this process's next claim on its store to
#: carry it (``Store.finish_and_claim``: one transaction, no sender woken) before a sender
#: writes it alone. A busy pool process claims its next (prefetched) task within a few
#: milliseconds; a process left idle writes it this much later.
CARRY_WITHIN = 0.02


class CarriedFinish:
    """A finish behind the return, as the next claim carries it: its lease and encoded
    result, and what to do with the store's verdict (or with a failure)."""

    def __init__(self, task: Any, handle: Execution, encoded: EncodedResult, request: Any,
                 heartbeat: Heartbeat, write: Any) -> None:
        self.task, self.handle, self.encoded, self.request = task, handle, encoded, request
        self._heartbeat, self._write = heartbeat, write

    @property
    def lease(self) -> Any:
        return self.handle.lease

    def done(self, accepted: bool) -> None:
        """The claim wrote it; the verdict's signals, with the finished task's request (as
        the task itself would have sent them)."""
        self.task.request_stack.push(self.request)
        try:
            _verdict(self.task, self.handle, accepted)
        finally:
            self.task.request_stack.pop()
            self._heartbeat.writes.carried(self.handle)

    def give_back(self) -> None:
        """The claim could not make it (the store failed): a sender writes it alone now."""
        self._heartbeat.writes.carried(self.handle)
        self._heartbeat.writes.queue(self.handle, self._write)


def finish_in_background(task: Any, handle: Execution, result: Any,
                         heartbeat: Heartbeat, *, carried: bool = False) -> None:
    """Queue the finish of ``handle`` with ``result``; the caller returns the result to Celery.

    ``result`` is encoded here, in the task, so a result the store cannot hold fails the task
    as a synchronous finish would (``ResultNotSerializable``), before anything is queued.
    ``carried``: the next claim of this process on the same store writes it, unless none came
    within ``CARRY_WITHIN`` (then a sender does); otherwise a sender writes it at once.
    """
    encoded = EncodedResult(encode_result(result))
    request = task.request  # the delivery's own Context: Celery pops it, and never changes it

    def write() -> None:
        task.request_stack.push(request)
        try:
            _finish(task, handle, encoded, heartbeat)
        finally:
            task.request_stack.pop()

    if not carried:
        heartbeat.writes.queue(handle, write)
        return
    carry = CarriedFinish(task, handle, encoded, request, heartbeat, write)
    heartbeat.writes.queue(handle, write, carry=carry, within=CARRY_WITHIN)


def _finish(task: Any, handle: Execution, encoded: EncodedResult,
            heartbeat: Heartbeat) -> None:
    try:
        accepted = handle.store.finish(handle.lease, encoded)
    except StoreError as exc:
        heartbeat.unwatch(handle)
        logger.warning("lease %s token %s: finish failed in the lease store (%s); the key "
                       "stays running until its lease expires, then the sweeper re-publishes "
                       "the task", handle.key, handle.token, exc)
        return
    _verdict(task, handle, accepted)


def _verdict(task: Any, handle: Execution, accepted: bool) -> None:
    """The completion's verdict on a finish written behind the return (a refused one's
    delivery is long acked: the sweeper re-publishes the key if nobody took it over)."""
    if accepted:
        Completion(task, handle).finished()
    else:
        Completion(task, handle).refused("finish refused: the lease expired or was taken over")
