"""A claim the store may have granted before its owner has read the reply.

Under green pools the claim's reply is read by the task's greenlet. A neighbour that
busy-loops holds the hub, so the reply can wait unread for longer than the ttl: the store
granted the lease, nobody renews it, it expires, and the delivery runs again under a second
token (issue 20). The heartbeat's threads are real OS threads there and keep running, so the
heartbeat is told of a claim *before* it is sent (``Heartbeat.claiming``). If the reply is still
unread when a renewal would be due, the heartbeat reads the row: one that names this claim's
owner was written by this very claim (owners are unique per execution, ``identity.py``), so it
is adopted and renewed like a held lease. When the reply is read at last, the handle takes the
latest adopted renewal (``Heartbeat.claimed``), and from then on it is an ordinary watched lease.

A claim can also wait *before* it is sent (a greenlet waiting for a pooled connection while
the hub is held): its reply then comes back fresh, long after ``sent_at``. A read that found
the row without this claim's owner, under a token below the one the claim returned, was made
before the claim's write (tokens only grow): the lease cannot expire before that read's send
plus the ttl, so the handle's deadline counts from there (``not_landed``).

Nothing here lets a claim outlive its row: adoption is a conditional renewal like any other,
judged by the store, and a row that names another owner, or none, is never touched.
"""

from __future__ import annotations

import time
from typing import Any

from ..models import Lease, LeaseRecord, LeaseState
from ..stores.base import Store
from . import green

__all__ = ["InFlight", "running_lease"]


def running_lease(record: LeaseRecord) -> Lease | None:
    """The lease a running row proves, as its claim returned it (None if it is not running)."""
    if record.state is not LeaseState.RUNNING or record.owner is None \
            or record.expires_at is None:
        return None
    return Lease(key=record.key, owner=record.owner, token=record.token,
                 expires_at=record.expires_at, fence=record.fence, attempts=record.attempts,
                 takeovers=record.takeovers, cancel=record.cancel)


class InFlight:
    """One claim between its send and the reading of its reply.

    Written by the heartbeat's sender (an adopted renewal) and by the task (the reply read):
    both under ``_lock``, a real lock held for a few statements that never yield."""

    def __init__(self, store: Store, key: str, owner: str, *, ttl: float,
                 heartbeat_interval: float) -> None:
        self.store = store
        self.key = key
        self.owner = owner
        self.ttl = ttl
        self.heartbeat_interval = heartbeat_interval
        self.sent_at = time.monotonic()  # before the send: no deadline outlives the store's
        #: When the heartbeat looks at it next (its first renewal, as for a held lease).
        self.next_renewal_at = self.sent_at + heartbeat_interval
        self._lock = green.lock()
        self._answered = False
        #: The latest renewal the heartbeat made of the adopted row, and when it was sent.
        self._renewed: tuple[Lease, float] | None = None
        #: The handle made from the reply, once read: later adopted renewals go to it.
        self._handle: Any = None
        #: The latest read that did not find the claim on the row: (sent at, token it saw).
        self._not_landed: tuple[float, int] | None = None

    @property
    def deadline(self) -> float:
        """Past this, with no renewal accepted (or read that showed the claim had not landed
        yet), the store may have let the lease go: the heartbeat stops looking."""
        renewed, not_landed = self._renewed, self._not_landed
        return max(self.sent_at, renewed[1] if renewed else 0.0,
                   not_landed[0] if not_landed else 0.0) + self.ttl

    @property
    def adopted(self) -> Lease | None:
        renewed = self._renewed
        return renewed[0] if renewed else None

    def answer(self, handle: Any) -> None:
        """The reply was read and made ``handle`` (None: no lease, or dropped). An adopted
        renewal, or a read that shows the claim landed later than it was sent, moves the
        handle's deadline on."""
        with self._lock:
            self._answered = True
            self._handle = handle
            renewed, not_landed = self._renewed, self._not_landed
        if handle is None:
            return
        if renewed is not None:
            handle.renewed(renewed[0], sent_at=renewed[1])
        elif not_landed is not None and not_landed[1] < handle.token:
            handle.renewed(handle.lease, sent_at=not_landed[0])

    def not_landed(self, sent_at: float, token_seen: int) -> None:
        """A read sent at ``sent_at`` found the row without this claim (``token_seen``: its
        token then, 0 for no row). It counts only within a ttl of the claim's send or of the
        previous such read: a later one could come after the claim landed, expired and its
        row was purged (nothing renewed it in between, or an adoption would have)."""
        with self._lock:
            since = self._not_landed[0] if self._not_landed else self.sent_at
            if sent_at < since + self.ttl:
                self._not_landed = (sent_at, token_seen)

    def renewed(self, lease: Lease, sent_at: float) -> None:
        """The heartbeat's renewal of the adopted row, sent at ``sent_at``, was accepted."""
        with self._lock:
            self._renewed = (lease, sent_at)
            handle = self._handle
        if handle is not None:  # the reply was read while the renewal was on its way
            handle.renewed(lease, sent_at=sent_at)

    @property
    def answered(self) -> bool:
        return self._answered
