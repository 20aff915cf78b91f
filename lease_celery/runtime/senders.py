"""The sender pool: threads that make a worker process's store calls off the task's path.

Renewal batches, settle confirmations, adoptions of claims in flight and finishes behind the
return wait here for a sender, so that the thread that schedules them never blocks on a
store: a slow reply (to a renewal, a confirmation) cannot hold the next renewal back.

Under green pools (-P gevent|eventlet) the senders are real OS threads (lease_celery/green.py),
so that a body that never yields cannot stop them.
"""

from __future__ import annotations

import logging
import queue
from collections.abc import Callable

from . import green

__all__ = ["MAX_SENDERS", "SENDERS", "SenderPool"]

logger = logging.getLogger(__name__)

#: Store calls that may wait for replies at once. A store that answers late must not hold the
#: next renewal back: a lease's deadline counts from when a renewal was *sent*, so a reply
#: slower than the interval would otherwise lose leases the store still holds. (On SQLite,
#: whose calls are serialized, they simply queue.)
SENDERS = 4
#: When every sender waits (calls hung on connections that died without a word wait for the
#: socket timeout, 5 s by default, longer than a short ttl), another sender is started, up to
#: this many: the next renewal, or a settle confirmation, still goes out on time.
MAX_SENDERS = 16


class SenderPool:
    """``SENDERS`` threads taking calls from one queue, more (up to ``MAX_SENDERS``) while
    every one of them waits on a call."""

    def __init__(self, *, name: str = "lease-send") -> None:
        self._name = name
        self._outbox: queue.SimpleQueue[Callable[[], None]] = green.simple_queue()
        # Senders started, and how many of them wait for a call now (a real lock: the
        # senders are real OS threads under green pools too).
        self._started, self._idle, self._lock = 0, 0, green.lock()
        for _ in range(SENDERS):
            self._start()

    @property
    def size(self) -> int:
        """How many senders were started."""
        with self._lock:
            return self._started

    def put(self, call: Callable[[], None]) -> None:
        """Queue ``call`` for a sender, reserving an idle one; start another sender if every
        one is busy (up to ``MAX_SENDERS``)."""
        with self._lock:
            reserved = self._idle > 0
            if reserved:
                self._idle -= 1
            more = not reserved and self._started < MAX_SENDERS
        if more:
            self._start(idle=False)  # it takes this call
        self._outbox.put(call)

    def each(self, call: Callable[[], None]) -> int:
        """Queue ``call`` once per sender started (a call that blocks until all have taken
        theirs reaches each sender once); returns how many."""
        senders = self.size
        for _ in range(senders):
            self._outbox.put(call)
        return senders

    def _start(self, *, idle: bool = True) -> None:
        with self._lock:
            n = self._started
            self._started += 1
            self._idle += idle
        green.start_thread(self._send, name=f"{self._name}-{n}")

    def _send(self) -> None:
        while True:
            call = self._outbox.get()
            try:
                call()
            except Exception:  # never let the thread die: a dead sender loses its calls
                logger.exception("lease heartbeat failed")
            finally:
                with self._lock:
                    self._idle += 1
