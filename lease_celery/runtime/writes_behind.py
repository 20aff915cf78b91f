"""Writes behind the task's return: an execution's last store call, made off the task's path.

A fire-and-forget task's finish (``execution.background``) is queued here. It is offered first
to this process's next claim on the same store, which carries it in its own transaction
(``take_carried``); one that no claim took within its ``within`` goes to a sender thread. The
heartbeat's thread keeps the appointments (``fall_due``, ``wake_times``) under its own
condition, which this shares: one thread and one lock for every timer of the process.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
import time
from collections.abc import Callable

from ..stores.base import Store
from . import green
from .execution import Execution, Phase

__all__ = ["WritesBehind"]

logger = logging.getLogger(__name__)


class WritesBehind:
    """The queued, carriable and in-flight writes of one process."""

    def __init__(self, wake: threading.Condition | green.Condition,
                 send: Callable[[Callable[[], None]], None], *, in_line: bool,
                 sleeping_until: Callable[[], float]) -> None:
        # ``sleeping_until``: when the scheduling thread wakes by itself (read with the lock).
        self._wake, self._send, self._sleeping_until = wake, send, sleeping_until
        # Under green pools the write is made in the task's greenlet: on a sender (a real OS
        # thread) it would use the store the tasks share, which is not safe across OS threads
        # there (lease_celery/green.py).
        self._in_line = in_line
        # Queued writes until a sender (or a claim) takes them, and the executions whose write
        # is being made now. A process that is going makes the queued ones itself and waits
        # for the others (``flush``).
        self._queued: dict[Execution, Callable[[], None]] = {}
        self._in_flight: set[Execution] = set()
        # Queued writes that the next claim on their store may carry, each with the instant it
        # goes to a sender if none has, its store and what the claim needs.
        self._carriable: dict[Execution, tuple[float, Store, object]] = {}
        # Threads in ``flush`` waiting for in-flight writes. Only they need to hear that one
        # ended: the scheduling thread waits on the same condition, and waking it for every
        # finish (twice per task when the next claim carries it) cost a wake-up per task that
        # it spent finding nothing to do.
        self._flushing = 0
        # When the scheduling thread looks at the carriable writes next because one fell due
        # (``queue`` woke it for that one): it keeps that appointment even if a claim carries
        # the write first. Woken for each finish instead, it would find the next claim had
        # already carried it, sleep until the next renewal, and be woken again by the next
        # task's finish: a wake-up per task. So finishes queued before that instant wake
        # nobody, and the thread wakes about once per ``within`` while finishes come.
        self._check_at = math.inf

    def queue(self, handle: Execution, write: Callable[[], None], *, carry: object = None,
              within: float = 0.0) -> None:
        """Make ``write`` (the handle's last store call) on a sender thread, soon. The handle
        stays watched until ``write`` unwatches it: a write that waits behind slow store calls
        keeps its lease alive meanwhile. A renewal refused once the write is queued means
        nothing (the write itself says whether the lease was still current).

        With ``carry``, the write waits up to ``within`` seconds for this process's next claim
        on the handle's store to take it (``take_carried``: ``carry`` is what that claim needs
        to make the write itself); only then does a sender make it. Under green pools it is
        made at once, in the task's greenlet (other greenlets run meanwhile)."""
        handle.enter(Phase.FINISHING)
        if self._in_line:
            try:
                write()
            except Exception:
                logger.exception("lease background write failed")
            return
        with self._wake:
            self._queued[handle] = write
            if carry is not None and within > 0:
                due = time.monotonic() + within
                self._carriable[handle] = (due, handle.store, carry)
                if due < self._sleeping_until():
                    self._check_at = min(self._check_at, due)
                    self._wake.notify()
                return
        self._send(functools.partial(self._write_queued, handle))

    def take_carried(self, store: Store) -> object | None:
        """What the oldest carriable write on ``store`` handed to ``queue`` (``carry``), now
        the caller's to make (end it with ``carried``), or None. Taken at most once: by one
        claim, by the sender it went to when nobody took it in time, or by ``flush``."""
        with self._wake:
            for handle, (_, owner_store, carry) in self._carriable.items():
                if owner_store is not store:
                    continue
                del self._carriable[handle]
                if self._queued.pop(handle, None) is None:
                    return None  # flushed meanwhile (the process is going)
                self._in_flight.add(handle)
                return carry
        return None

    def carried(self, handle: Execution) -> None:
        """A claim made (or gave back) the write it took with ``take_carried``."""
        with self._wake:
            self._in_flight.discard(handle)
            if self._flushing:
                self._wake.notify_all()

    def fall_due(self, now: float) -> None:
        """Send the carriable writes that no claim took in time. Call with the lock held."""
        uncarried = [h for h, (due, _, _) in self._carriable.items() if due <= now]
        for handle in uncarried:
            del self._carriable[handle]
            self._send(functools.partial(self._write_queued, handle))

    def wake_times(self, now: float) -> list[float]:
        """When the scheduling thread must look again. Call with the lock held."""
        times = [due for due, _, _ in self._carriable.values()]
        if self._check_at <= now:
            self._check_at = math.inf  # kept (what fell due was sent by ``fall_due``)
        elif self._check_at < math.inf:
            times.append(self._check_at)
        return times

    def flush(self, timeout: float) -> None:
        """Make the queued writes now, in the calling thread, and wait up to ``timeout``
        seconds for those a sender is making (the process is going)."""
        with self._wake:
            queued = list(self._queued.values())
            self._queued.clear()
            self._carriable.clear()
        for write in queued:
            try:
                write()
            except Exception:
                logger.exception("lease background write failed")
        deadline = time.monotonic() + timeout
        with self._wake:
            self._flushing += 1
            try:
                while self._in_flight and time.monotonic() < deadline:
                    self._wake.wait(deadline - time.monotonic())
            finally:
                self._flushing -= 1

    def _write_queued(self, handle: Execution) -> None:
        with self._wake:
            write = self._queued.pop(handle, None)
            if write is None:
                return  # the process flushed it itself
            self._in_flight.add(handle)
        try:
            write()
        finally:
            self.carried(handle)
