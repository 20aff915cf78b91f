"""Completion: where an execution's outcome is written, and its verdict said once.

However an attempt ends, one ``Completion`` writes it to the store, says what became of it
(the log line and the signals), hands the key's limit group on to its waiters, and arms the
settle phase when Celery has yet to store the outcome. A finish is written in one of three
ways (``LeaseSettings.finish_mode``): in line, when Celery's next step depends on the verdict;
on a sender thread behind the task's return; or carried by the process's next claim
(``background``). The verdict is the same wherever the write was made.

What the task does about a refused outcome (drop it, or re-publish the delivery) is the
gate's: ``refused`` only says it, and tells whether someone else has the key now.
"""

from __future__ import annotations

import logging
from typing import Any

from .. import signals
from ..errors import StoreError
from ..runtime.execution import Execution, Phase
from ..runtime.heartbeat import Heartbeat
from .limited import hand_on
from .outage import StoreWait, finish_waiting

__all__ = ["Completion"]

logger = logging.getLogger(__name__)


class Completion:
    """The outcome writes of ``execution``, made for ``task`` (the sender of the signals)."""

    def __init__(self, task: Any, execution: Execution) -> None:
        self.task, self.execution = task, execution

    # -- the writes ----------------------------------------------------------------------------

    def finish(self, result: Any, *, settle_within: float | None,
               wait: StoreWait | None) -> bool:
        """Write the finish in line (waiting out a short outage as a claim does); on
        acceptance say so. ``StoreError`` and ``ResultNotSerializable`` reach the caller; a
        refusal is the caller's to act on (``refused``)."""
        execution = self.execution
        accepted = finish_waiting(execution.store, execution.lease, result,
                                  settle_within=settle_within, wait=wait)
        if accepted:
            self.finished(settle_within=settle_within)
        return accepted

    def kill(self, reason: str, *, settle_within: float | None,
             error: Any = None) -> bool | None:
        """Mark the key dead with ``reason`` (and ``error``, the failure as Celery stores it,
        ``answers.stored_failure``); the failure then settles like a finish when
        ``settle_within`` is not None. None when the store could not answer (the lease then
        expires, and the sweeper brings the task back)."""
        execution = self.execution
        try:
            killed = execution.store.kill(execution.lease, reason=reason[:2000],
                                          settle_within=settle_within, error=error)
        except StoreError:
            logger.exception("lease %s: could not mark it dead (%s)", execution.key, reason)
            return None
        if not killed:
            return False
        if settle_within is not None:
            self._arm_settling()
        hand_on(self.task, execution.store, execution.lease.group)
        logger.error("lease %s is dead after %s attempt(s): %s", execution.key,
                     execution.lease.attempts, reason)
        signals.lease_dead.send(sender=self.task, key=execution.key, lease=execution.lease,
                                reason=reason, hold_time=execution.held_for)
        return True

    def release(self, reason: str, *, delay: float = 0.0, message: Any = None,
                counted: bool = True) -> bool | None:
        """Give the key back (``Store.release``: after ``delay``, ``message`` the delivery
        that claims it next, ``counted=False`` the attempt given back). None when the store
        could not answer (the lease then expires)."""
        execution = self.execution
        try:
            released = execution.store.release(execution.lease, delay=delay,
                                               reason=reason[:2000], task=message,
                                               counted=counted)
        except StoreError:
            logger.exception("lease %s token %s: release failed; the lease will expire at %s",
                             execution.key, execution.token, execution.lease.expires_at)
            return None
        if released:
            hand_on(self.task, execution.store, execution.lease.group)
            signals.lease_released.send(sender=self.task, key=execution.key,
                                        lease=execution.lease, hold_time=execution.held_for)
        return released

    # -- the verdicts --------------------------------------------------------------------------

    def finished(self, *, settle_within: float | None = None) -> None:
        """A finish was accepted (in line, by a sender, or carried by a claim)."""
        execution = self.execution
        if settle_within is not None:
            execution.enter(Phase.SETTLING)  # still renewed, until Celery stored the outcome
        else:
            _heartbeat().unwatch(execution)
        lease = execution.lease  # read once: this runs after every task
        logger.info("lease %s token %s finished", lease.key, lease.token)
        if lease.group is not None:
            hand_on(self.task, execution.store, lease.group)
        signals.lease_finished.send(sender=self.task, key=lease.key, lease=lease,
                                    hold_time=execution.held_for,
                                    duration=execution.body_seconds)

    def retrying(self, reason: str, *, delay: float) -> None:
        """The lease's own error retry (``lease_retry_errors``) was published and the key
        released for ``delay`` seconds."""
        execution = self.execution
        logger.warning("lease %s: %s; retrying in %.2fs", execution.key, reason, delay)
        signals.lease_retry.send(sender=self.task, key=execution.key, lease=execution.lease,
                                 reason=reason, countdown=delay)

    def refused(self, reason: str) -> bool:
        """The store refused this execution's outcome: its lease is lost, and the outcome is
        not the key's. Returns whether someone else has the key now (an unanswered read
        counts as taken: dropping an outcome is safe, writing it twice is not)."""
        execution = self.execution
        _heartbeat().unwatch(execution)
        execution.mark_lost(reason)
        taken = execution.taken_over()
        logger.warning("lease %s owner %s token %s: stale outcome rejected: %s%s",
                       execution.key, execution.owner, execution.token, reason,
                       "" if taken else "; nobody took the key over")
        signals.stale_result_rejected.send(sender=self.task, key=execution.key,
                                           lease=execution.lease, reason=reason,
                                           hold_time=execution.held_for)
        return taken

    def _arm_settling(self) -> None:
        """Celery has yet to store the outcome: renew the settle deadline until it has
        (``settle.confirm_stored``), and let ``after_return`` find the execution."""
        execution = self.execution
        execution.enter(Phase.SETTLING)
        self.task.request.lease = execution
        _heartbeat().watch(execution)


def _heartbeat() -> Heartbeat:
    """This process's heartbeat: the one that renewed the execution (no lock to ask for it)."""
    return Heartbeat.current() or Heartbeat.for_process()
