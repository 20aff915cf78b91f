"""A delivery that meets an unavailable store waits for it, for about a ttl, before deferring.

Before this, a claim that met an unavailable store (its server restarting, a failover, a
SQLite file locked past its busy timeout) re-published the delivery at once. During an outage
every delivery that arrived was deferred, and came back to be deferred again while the outage
lasted: one chaos run with six restarts of a Redis store re-published 1,485 deliveries, and a
deferred copy waiting for its ETA in a worker that was then killed sat in the broker's unacked
hash for the whole visibility timeout. A restart takes a second or two, so the delivery now
tries the claim again, with a growing pause, for about one ttl: a blip costs the wait and
nothing else, and a longer outage is deferred after the bound, as before. A finish that meets
an outage waits the same way (``finish_waiting``): given up at once, its body ran again.

A claim that waits holds no lease: nothing to renew, nothing to expire; a finish that waits
holds its lease, which the heartbeat renews as soon as the store answers (if the lease expired
meanwhile, the store refuses the finish, as it would have refused a late one). The wait is

- bounded: about one ``lease_ttl`` from the first failure (not from the first try: a try
  that was under way when the outage began, slowed by a stall or slow replies, or by the
  PostgreSQL store's own reconnecting, must not leave the wait nothing), and at most half of
  the task's time limit (Celery counts those from the start of the task: the wait must leave
  the body its time, and a hard limit hit in the wait would store a FAILURE for work that
  never ran);
- interruptible: when the worker shuts down (``celery.worker.state``, set by the signal
  handlers of the process running the task: solo, threads, gevent and eventlet pools), the
  wait ends and the delivery is deferred at once, so nothing is lost and the worker need not
  wait for the store to stop. A prefork child is not told of a warm shutdown (its parent waits
  for its tasks: the bound keeps that short), and the SIGTERM of a cold one raises
  ``SystemExit`` in the sleep, which passes through;
- a pause for the pool: prefork's other children and other threads go on; under gevent and
  eventlet ``time.sleep`` is the hub's (Celery monkey-patches before the app is imported), so
  the worker's other greenlets run.

The pauses grow from ``FIRST_PAUSE`` to a quarter of the bound (``LONGEST_PAUSE`` at most),
each drawn at random from its upper half, so the deliveries waiting for one server do not all
try again in the same instant when it comes back.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from typing import Any, TypeVar

from celery.worker import state as worker_state

from ..errors import StoreDataLost, StoreError
from ..models import Lease, LeaseState
from ..stores.base import Store

__all__ = ["FIRST_PAUSE", "LONGEST_PAUSE", "StoreWait", "deferral_reason", "finish_waiting",
           "retrying", "wait_bound", "worker_stopping"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Seconds before the first try again; each pause doubles the last one.
FIRST_PAUSE = 0.05
#: The longest pause (seconds), so a worker that shuts down waits for at most about that.
LONGEST_PAUSE = 1.0
#: The sleeps are cut into slices this long (seconds) to notice a shutdown in between.
SLICE = 0.25


def worker_stopping() -> bool:
    """Whether the worker running this process's tasks is shutting down, warm or cold.

    Celery's shutdown handlers set ``should_stop`` / ``should_terminate`` to an exit code,
    and 0 (``EX_OK``) means "stop" too: only None and False mean "go on"."""
    return any(flag is not None and flag is not False
               for flag in (worker_state.should_stop, worker_state.should_terminate))


def wait_bound(task: Any, ttl: float) -> float:
    """How long a delivery of ``task`` waits for the store: ``ttl``, and at most half of the
    delivery's time limit (hard or soft, the message's own or the task's)."""
    limits = getattr(task.request, "timelimit", None) or (None, None)
    hard = limits[0] or getattr(task, "time_limit", None)
    soft = limits[1] or getattr(task, "soft_time_limit", None)
    bound = ttl
    for limit in (hard, soft):
        if limit:
            bound = min(bound, float(limit) / 2)
    return bound


class StoreWait:
    """One delivery's wait for an unavailable store: :meth:`again` after each failed try.

    Made for every delivery, so it does nothing until a first failure: no clock read, no
    bound worked out (one claim costs tens of microseconds; this costs well under one)."""

    def __init__(self, task: Any, ttl: float, key: str, *, step: str = "delivery",
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep,
                 stopping: Callable[[], bool] = worker_stopping) -> None:
        self._task, self._ttl, self._key, self._step = task, ttl, key, step
        self._clock, self._sleep, self._stopping = clock, sleep, stopping
        self.tries = 0
        self.interrupted = False  # the worker began shutting down

    @property
    def what(self) -> str:
        """``delivery <task id> of <key>`` (or ``the finish of …``), for the log."""
        return f"{self._step} {getattr(self._task.request, 'id', None)} of {self._key}"

    @property
    def waited(self) -> float:
        """Seconds since the first failure (0 before it)."""
        return self._clock() - self.started if self.tries else 0.0

    def again(self, exc: StoreError) -> bool:
        """The last try failed with ``exc``: pause, then True for another try (the last one at
        the bound); False, without pausing, once the bound has passed or the worker shuts
        down."""
        self.tries += 1
        if self.tries == 1:
            self.bound = wait_bound(self._task, self._ttl)
            self.started = self._clock()
            self.deadline = self.started + self.bound
            self._pause = FIRST_PAUSE
            self._longest = max(FIRST_PAUSE, min(LONGEST_PAUSE, self.bound / 4))
            logger.warning("lease store unavailable (%s): %s waits up to %.1fs for it",
                           exc, self.what, self.bound)
        if self._clock() >= self.deadline:
            return False
        pause = random.uniform(self._pause / 2, self._pause)
        self._pause = min(self._pause * 2, self._longest)
        wake = min(self._clock() + pause, self.deadline)
        while True:
            if self._stopping():
                self.interrupted = True
                return False
            left = wake - self._clock()
            if left <= 0:
                return True
            self._sleep(min(left, SLICE))

    def reason(self, exc: StoreError, *, failed: str = "the lease store failed") -> str:
        """Why the delivery is deferred after all (the chaos harness reads ``failed``)."""
        why = f"{failed} ({exc}) for {self.waited:.1f}s, {self.tries} tries"
        return why + ("; the worker is shutting down" if self.interrupted else "")

    def recovered(self) -> None:
        if self.tries:
            logger.info("lease store answered again after %.1fs (%d tries): %s goes on",
                        self.waited, self.tries, self.what)


def deferral_reason(wait: StoreWait | None, exc: StoreError, *,
                    failed: str = "the lease store failed") -> str:
    """Why a delivery is deferred for the store: ``failed`` and the error, and how long it
    waited (an eager or direct call, ``wait`` None, did not)."""
    return wait.reason(exc, failed=failed) if wait is not None else f"{failed} ({exc})"


def retrying(attempt: Callable[[], T], wait: StoreWait | None) -> T:
    """``attempt()``, tried again while it raises ``StoreError`` and ``wait`` allows another
    try (None: no second try); the last ``StoreError`` goes to the caller. ``StoreDataLost``
    goes at once: the store answered, and only an operator's reset-epoch changes its answer."""
    while True:
        try:
            result = attempt()
        except StoreDataLost:
            raise
        except StoreError as exc:
            if wait is None or not wait.again(exc):
                raise
            continue
        if wait is not None:
            wait.recovered()
        return result


def finish_waiting(store: Store, lease: Lease, result: Any, *, settle_within: float | None,
                   wait: StoreWait | None) -> bool:
    """``store.finish``, tried again as a claim is while the store cannot answer (the heartbeat
    goes on renewing the lease meanwhile, once the store answers again). True if accepted.

    A try whose reply was lost may have landed: the next one is then refused, and a row done
    with this lease's owner and token (``settled_by``) says that the write was ours."""
    tried = False

    def attempt() -> bool:
        nonlocal tried
        again, tried = tried, True
        if store.finish(lease, result, settle_within=settle_within):
            return True
        return again and store.settled_by(lease, LeaseState.DONE)

    return retrying(attempt, wait)
