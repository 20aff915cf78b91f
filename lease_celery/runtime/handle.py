"""LeaseHandle: the lease a running task holds, as the task body sees it (``self.lease``)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from ..checks import encode_checkpoint
from ..errors import LeaseCancelled, LeaseLost, StoreError
from ..models import Lease
from ..stores.base import Store
from . import green

__all__ = ["LeaseHandle"]

_UNREAD: Any = object()  # checkpoint_data not read from the store yet


class LeaseHandle:
    """The current lease of one task execution, kept up to date by the heartbeat.

    A task body reads ``key``, ``owner``, ``token``, ``expires_at`` and ``fence``, calls
    ``check()`` between steps, ``checkpoint()`` / ``checkpoint_data`` for long work, and
    ``fenced()`` / ``effect()`` for fenced writes and outside actions; ``lost`` and
    ``cancelled`` say, without raising, what ``check()`` would raise for. Everything else is
    the heartbeat's and the gate's (underscored).

    ``check()`` raises :class:`LeaseLost` once the lease is known lost: a renewal was refused, or
    no renewal succeeded before the deadline (measured on this process's monotonic clock from the
    moment the last successful request was *sent*, so it never outlives the store's deadline).
    """

    def __init__(self, lease: Lease, *, store: Store, ttl: float, heartbeat_interval: float,
                 sent_at: float, task: Any = None) -> None:
        self._store = store
        self._ttl = ttl
        self._heartbeat_interval = heartbeat_interval
        self._task = task
        # Taken by the heartbeat's threads too: a real lock, even under green pools.
        self._lock = green.lock()
        self._lease = lease  # the latest accepted renewal's (the claim's until one is)
        self._claimed_at = sent_at
        self._local_deadline = sent_at + ttl
        self._next_renewal_at = sent_at + heartbeat_interval
        self._lost_reason: str | None = None
        self._closed = False  # set when the task stops heartbeating it (finish, release)
        self._body_duration = 0.0  # seconds the task body ran (set when it returns)
        # The key is done (or dead) under this lease, and Celery has yet to store the outcome:
        # the heartbeat keeps the settle deadline alive until the owner confirms (settle.py).
        self._settling = False
        # Celery stored the outcome and the owner's confirmation is on its way: the heartbeat
        # still renews the settle deadline until the store answers it (heartbeat.settle).
        self._confirming = False
        # The finish is queued on the heartbeat's sender threads (``background``): the task
        # returned, and that write, not a renewal, says whether the lease was still current.
        self._writing = False
        # An operator's cancel, as the claim or a renewal brought it ("cancelled: ...").
        self._cancel: str | None = lease.cancel
        # The key's checkpoint as this execution knows it: unread (_UNREAD) until asked for.
        self._checkpoint: Any = _UNREAD

    # -- what the task body reads ---------------------------------------------------------

    @property
    def key(self) -> str:
        """The lease key (the task's ``lease_key`` filled in with its arguments)."""
        return self._lease.key

    @property
    def owner(self) -> str:
        """This execution as the store knows it (``hostname:pid:uuid4/n`` in a worker)."""
        return self._lease.owner

    @property
    def token(self) -> int:
        """This claim's generation on the key: +1 per successful claim, never reused."""
        return self._lease.token

    @property
    def expires_at(self) -> float:
        """When the store lets the lease go unless renewed (epoch seconds, the store's clock;
        moved on by each accepted renewal)."""
        return self._lease.expires_at

    @property
    def fence(self) -> int:
        """The store-wide fence of this claim, for a resource's ``FenceGate``."""
        return self._lease.fence

    @property
    def attempts(self) -> int:
        """How many claims of the key counted as attempts, this one included (a Celery retry
        or a ``replace()`` gives its attempt back: it is the task's own control flow)."""
        return self._lease.attempts

    @property
    def takeovers(self) -> int:
        """How many claims of the key found the previous owner's lease expired."""
        return self._lease.takeovers

    @property
    def lost(self) -> str | None:
        """Why the lease is lost once this execution may no longer hold it (a renewal or a
        write refused, or no renewal succeeded before the deadline); None while it holds.
        An operator's cancel is :attr:`cancelled`; ``check()`` raises for either."""
        if self._lost_reason is None and time.monotonic() >= self._local_deadline:
            return "no renewal succeeded before the lease deadline"
        return self._lost_reason

    @property
    def cancelled(self) -> str | None:
        """``cancelled: …`` once an operator cancelled the key (seen at the claim or a renewal,
        so within one heartbeat interval of ``celery leases cancel``); None otherwise."""
        return self._cancel

    def check(self) -> None:
        """Raise :class:`LeaseLost` if this execution may no longer hold the lease, and
        :class:`LeaseCancelled` (a ``LeaseLost``) once an operator cancelled the key."""
        if self._cancel is not None:
            raise LeaseCancelled(f"lease {self.key!r} (token {self.token}) was {self._cancel}; "
                                 f"stop the protected work")
        reason = self.lost
        if reason is not None:
            raise LeaseLost(f"lease {self.key!r} (owner {self.owner}, token {self.token}) "
                            f"is lost: {reason}; stop the protected work")

    def checkpoint(self, data: Any) -> None:
        """Record progress ``data`` (JSON) on the lease row, fenced and durable on return.

        Only the current holder's write is accepted: otherwise ``LeaseLost`` is raised and
        nothing is written. The next owner of the key (a takeover, a retry, a requeue) reads it
        as ``checkpoint_data`` and resumes from there; it is cleared when the key is done.
        """
        encoded = encode_checkpoint(data)  # CheckpointNotSerializable before any write
        self.check()
        if not self._store.checkpoint(self._lease, encoded):
            reason = "checkpoint refused: the lease expired or was taken over"
            self._mark_lost(reason)
            raise LeaseLost(f"lease {self.key!r} (owner {self.owner}, token {self.token}) "
                            f"is lost: {reason}; stop the protected work")
        self._checkpoint = json.loads(encoded)  # what a reader of the row gets back

    @property
    def checkpoint_data(self) -> Any:
        """The key's latest checkpoint: this execution's last one, else what a previous
        generation left (read from the store once), or None on a fresh key."""
        if self._checkpoint is _UNREAD:
            record = self._store.get(self.key)
            self._checkpoint = None if record is None else record.checkpoint
        return self._checkpoint

    def fenced(self) -> AbstractContextManager[Any]:
        """A transaction on the lease store in which this lease is verified current.

        ``with self.lease.fenced() as conn: conn.execute(...)`` — your writes commit only if
        the lease is still this execution's at commit; otherwise ``LeaseLost`` is raised and
        nothing is committed. PostgreSQL and SQLite stores only (your tables must live in the
        store's database).
        """
        self.check()
        return self._store.fenced(self._lease)

    def effect(self, key: str, payload: Any, fn: Callable[[str], Any], *,
               retry_same_key: bool = False, wait: float = 0.0) -> Any:
        """Perform an outside action at most once per business ``key`` (see ``Effects.once``).

        Checks the lease first: a worker that lost its lease does not start new actions.
        """
        self.check()
        return self._store.effects.once(key, payload, fn, lease=self._lease,
                                        retry_same_key=retry_same_key, wait=wait)

    # -- what the heartbeat and the gate use ------------------------------------------------

    @property
    def _held_for(self) -> float:
        """Seconds since the claim was sent."""
        return time.monotonic() - self._claimed_at

    def _renewed(self, lease: Lease, *, sent_at: float) -> None:
        """A renewal sent at ``sent_at`` was accepted. Renewals may overlap (a slow store):
        only one sent later than the last accepted one moves the deadline."""
        with self._lock:
            if lease.cancel is not None:
                self._cancel = lease.cancel
            if sent_at + self._ttl > self._local_deadline:
                self._lease = lease
                self._local_deadline = sent_at + self._ttl

    def _holds_row(self) -> bool | None:
        """Is the key's row still this execution's (its owner, its token)? None when the store
        cannot answer: each caller decides what an unanswered read means."""
        try:
            record = self._store.get(self.key)
        except StoreError:
            return None
        return record is not None and record.held_by(self.owner, self.token)

    def _taken_over(self) -> bool:
        """After a refused outcome: has someone else the key now (another owner's token on the
        row, or no row)? Then this outcome is stale and dropped. An unanswered read counts as
        taken: dropping an outcome is safe, writing it twice is not."""
        return self._holds_row() is not True

    def _mark_lost(self, reason: str) -> bool:
        """Record the loss; return True the first time (so the loss is announced once)."""
        with self._lock:
            if self._lost_reason is not None:
                return False
            self._lost_reason = reason
            return True

    def __repr__(self) -> str:
        lost = self.lost
        state = "held" if lost is None else f"lost: {lost}"
        return f"<LeaseHandle {self.key!r} token={self.token} owner={self.owner} {state}>"
