"""Settle confirmations: the owner's word that Celery stored an execution's outcome.

Once Celery stored a task's outcome (``after_return``), the owner's confirmation ends the
key's settle phase (DESIGN.md §6). It is queued here and sent in batches, one round trip per
store (``settle_many``), so the task's own path pays none. Until the store answers, the
heartbeat keeps renewing the settle deadline: a confirmation that waits (a slow reply, a busy
sender, an unreachable store) must not let the deadline pass under a living owner, or a
redelivery would complete the key and Celery store the outcome a second time. The heartbeat's
thread sends them (``take_due``, ``wake_times``) under its own condition, which this shares.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable

from .. import signals
from ..errors import LeaseError
from ..stores.base import Store
from . import green
from .execution import Execution

__all__ = ["Confirmations"]

logger = logging.getLogger(__name__)

#: How soon a confirmation is sent again after the store failed to answer.
RETRY_AFTER_ERROR = 0.5


class Confirmations:
    """The confirmations of one process waiting to be sent."""

    def __init__(self, wake: threading.Condition | green.Condition,
                 closed: Callable[[Execution], None]) -> None:
        # ``closed``: the heartbeat stops renewing an execution whose confirmation is answered.
        self._wake, self._closed = wake, closed
        self._pending: list[Execution] = []
        self._after = 0.0  # monotonic time before which a failed batch is not sent again

    def add(self, handle: Execution) -> None:
        """Send ``handle``'s confirmation with the next batch."""
        with self._wake:
            self._pending.append(handle)
            if len(self._pending) == 1:  # later ones join the batch the thread will send
                self._wake.notify()

    def take_due(self, now: float) -> list[Execution]:
        """The batch to send now (empty while a failed one waits). Call with the lock held."""
        if not self._pending or now < self._after:
            return []
        due, self._pending = self._pending, []
        return due

    def wake_times(self) -> list[float]:
        """When the scheduling thread must look again. Call with the lock held."""
        return [self._after] if self._pending else []

    def flush(self) -> None:
        """Send the queued confirmations now, in the calling thread (the process is going)."""
        with self._wake:
            pending, self._pending = self._pending, []
        self.send(pending)

    def send(self, handles: list[Execution]) -> None:
        """Confirm these outcomes, one round trip per store. A store that fails is asked again
        shortly, until it answers: the confirmation is idempotent, and worth sending even past
        the settle deadline (until a redelivery takes the settlement over, it is what keeps the
        outcome from being stored twice)."""
        groups: dict[Store, list[Execution]] = defaultdict(list)
        for handle in handles:
            groups[handle.store].append(handle)
        for store, group in groups.items():
            try:
                # This thread's own copy of the store under green pools (green.thread_store).
                answers = green.thread_store(store).settle_many([h.lease for h in group])
            except LeaseError as exc:
                logger.warning("lease settle confirmation failed (%s); %d retried", exc,
                               len(group))
                with self._wake:
                    self._pending += group
                    self._after = time.monotonic() + RETRY_AFTER_ERROR
                    self._wake.notify()  # the scheduler recomputes when to wake
                continue
            for handle, settled in zip(group, answers, strict=True):
                self._closed(handle)
                if settled:
                    signals.lease_settled.send(sender=handle.task, key=handle.key,
                                               lease=handle.lease)
                else:
                    logger.warning("lease %s token %s: settle refused (completed by another "
                                   "delivery after the settle deadline)", handle.key,
                                   handle.token)
