"""Execution: one claim of a key by one delivery, and the single owner of its state.

The gate (``LeasedTask``), the completion of its outcome and the renewer all act on an
execution, through its methods: none of them keeps a flag of its own about it. Its phase is
one value, moved forward by the code that knows what happened:

``running``
    the body runs; the renewer renews the lease.
``finishing``
    the body returned and its finish is queued behind the return (``completion``): still
    renewed, but a refused renewal means nothing now, the finish's own verdict decides.
``settling``
    the key is done (or dead) under this lease and Celery has yet to store the outcome: the
    renewer keeps the settle deadline alive (DESIGN.md §6).
``confirming``
    Celery stored the outcome; the owner's confirmation is on its way, and the deadline is
    renewed until the store answers it.
``closed``
    nothing left to renew: released, finished and settled, or handed on.
``lost``
    the store refused this lease (a renewal, a write), or no renewal landed before the local
    deadline; terminal.

The body sees a read-only view of it, :class:`~lease_celery.runtime.handle.LeaseHandle`
(``self.lease``).
"""

from __future__ import annotations

import dataclasses
import enum
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from ..errors import LeaseError, StoreError
from ..models import Lease
from ..stores.base import Store
from . import green
from .handle import LeaseHandle

__all__ = ["AppFinish", "Execution", "Phase"]


class Phase(enum.Enum):
    RUNNING = "running"
    FINISHING = "finishing"
    SETTLING = "settling"
    CONFIRMING = "confirming"
    CLOSED = "closed"
    LOST = "lost"


@dataclasses.dataclass(frozen=True)
class AppFinish:
    """The finish written in the app's own transaction (``LeaseHandle.transaction``)."""

    #: The key's result as the row keeps it.
    result: Any
    #: The settle deadline it was written with (None: settled at once).
    settle_within: float | None
    #: Did lease_celery commit it itself? False: the app's transaction, still open when the
    #: block ended, commits it (or not) later.
    committed: bool


#: Opens the app-transaction completion for an execution and an app connection (the gate's).
Transactions = Callable[["Execution", Any], AbstractContextManager[Any]]


#: Phases whose renewal answers count: a refusal in any other means nothing any more.
_RENEWED = frozenset({Phase.RUNNING, Phase.SETTLING, Phase.CONFIRMING})


class Execution:
    """One claim of ``lease.key`` by this process: the lease (the latest accepted renewal's),
    the local deadline, the phase, and the task it runs for.

    The local deadline is measured on this process's monotonic clock from the moment the last
    accepted request was *sent*, so it never outlives the store's deadline.
    """

    def __init__(self, lease: Lease, *, store: Store, ttl: float, heartbeat_interval: float,
                 sent_at: float, task: Any = None, transactions: Transactions | None = None
                 ) -> None:
        self._store, self._ttl, self._interval, self._task = store, ttl, heartbeat_interval, task
        self._transactions = transactions
        # Taken by the renewer's threads too: a real lock, even under green pools.
        self._lock = green.lock()
        self._lease = lease
        self._claimed_at = sent_at
        self._deadline = sent_at + ttl
        self._phase = Phase.RUNNING
        self._lost_reason: str | None = None
        self._cancel: str | None = lease.cancel
        self._body_seconds = 0.0
        self._view: LeaseHandle | None = None  # made when the body first asks for it
        self._in_app_transaction = False
        self._app_finish: AppFinish | None = None

    # -- what it is ---------------------------------------------------------------------------

    @property
    def lease(self) -> Lease:
        """The claim's lease, as the latest accepted renewal left it."""
        return self._lease

    @property
    def store(self) -> Store:
        return self._store

    @property
    def ttl(self) -> float:
        return self._ttl

    @property
    def heartbeat_interval(self) -> float:
        return self._interval

    @property
    def task(self) -> Any:
        """The task this execution runs for: the sender of its signals."""
        return self._task

    @property
    def view(self) -> LeaseHandle:
        """What the task body sees (``self.lease``): a read-only ``LeaseHandle``."""
        if self._view is None:
            self._view = LeaseHandle(self)
        return self._view

    @property
    def key(self) -> str:
        return self._lease.key

    @property
    def owner(self) -> str:
        return self._lease.owner

    @property
    def token(self) -> int:
        return self._lease.token

    @property
    def phase(self) -> Phase:
        return self._phase

    @property
    def local_deadline(self) -> float:
        """When this process stops trusting the lease (monotonic), unless a renewal lands."""
        return self._deadline

    @property
    def claimed_at(self) -> float:
        """When the claim was sent (monotonic)."""
        return self._claimed_at

    @property
    def held_for(self) -> float:
        """Seconds since the claim was sent."""
        return time.monotonic() - self._claimed_at

    @property
    def body_seconds(self) -> float:
        """Seconds the body ran (0 until it returned)."""
        return self._body_seconds

    @property
    def lost(self) -> str | None:
        """Why the lease is lost (refused, or no renewal landed before the local deadline);
        None while it holds."""
        if self._lost_reason is None and time.monotonic() >= self._deadline:
            return "no renewal succeeded before the lease deadline"
        return self._lost_reason

    @property
    def cancelled(self) -> str | None:
        """``cancelled: …`` once an operator's cancel reached this execution."""
        return self._cancel

    @property
    def in_app_transaction(self) -> bool:
        """Is the body inside ``LeaseHandle.transaction``, whose app connection holds the
        key's row lock? (A write of the store's own on the row would wait for it.)"""
        return self._in_app_transaction

    @property
    def app_finish(self) -> AppFinish | None:
        """The finish the app's transaction wrote, once it did."""
        return self._app_finish

    @property
    def renewal_counts(self) -> bool:
        """Does a renewal's answer still say something about this execution? (A refusal while
        finishing, or after it closed, means nothing: its own write decides.)"""
        return self._phase in _RENEWED

    # -- what happens to it -------------------------------------------------------------------

    def body_returned(self, seconds: float) -> None:
        self._body_seconds = seconds

    def renewed(self, lease: Lease, *, sent_at: float) -> None:
        """A renewal (or the claim's adoption) sent at ``sent_at`` was accepted. Renewals may
        overlap (a slow store): only one sent later than the last accepted one moves the
        deadline."""
        with self._lock:
            if lease.cancel is not None:
                self._cancel = lease.cancel
            if sent_at + self._ttl > self._deadline:
                self._lease = lease
                self._deadline = sent_at + self._ttl

    def transaction(self, connection: Any) -> AbstractContextManager[Any]:
        """The app-transaction completion on ``connection`` (``LeaseHandle.transaction``)."""
        if self._transactions is None:
            raise LeaseError("this execution cannot complete in the app's transaction: it is "
                             "no delivery of a LeasedTask body")
        if self._in_app_transaction or self._app_finish is not None:
            raise LeaseError(f"lease {self.key!r}: the finish is written once, in one "
                             "transaction; this body opened one already")
        return self._transactions(self, connection)

    def app_transaction_open(self, is_open: bool) -> None:
        self._in_app_transaction = is_open

    def finish_written_in_app(self, finish: AppFinish) -> None:
        """The app's transaction wrote the finish: from now on a refused renewal means
        nothing (the row is done, or settling under a new deadline); that transaction's commit
        decides."""
        self._app_finish = finish
        self.enter(Phase.FINISHING)

    def mark_lost(self, reason: str) -> bool:
        """The lease is lost; True the first time (so that the loss is announced once)."""
        with self._lock:
            if self._lost_reason is not None:
                return False
            self._lost_reason = reason
            self._phase = Phase.LOST
            return True

    def enter(self, phase: Phase) -> None:
        """Move on to ``phase`` (a lost execution stays lost)."""
        with self._lock:
            if self._phase is not Phase.LOST:
                self._phase = phase

    def settling_past_deadline(self) -> bool:
        """Settling, but its own clock saw the settle deadline pass (it stalled before Celery
        stored the outcome): a delivery may have completed the key meanwhile."""
        return self._phase is Phase.SETTLING and time.monotonic() >= self._deadline

    def holds_row(self) -> bool | None:
        """Is the key's row still this execution's (its owner, its token)? None when the store
        cannot answer: each caller decides what an unanswered read means."""
        try:
            record = self._store.get(self.key)
        except StoreError:
            return None
        return record is not None and record.held_by(self.owner, self.token)

    def taken_over(self) -> bool:
        """After a refused outcome: has someone else the key now (another owner's token on the
        row, or no row)? Then this outcome is stale and dropped. An unanswered read counts as
        taken: dropping an outcome is safe, writing it twice is not."""
        return self.holds_row() is not True

    def __repr__(self) -> str:
        return (f"<Execution {self.key!r} token={self.token} owner={self.owner} "
                f"{self._phase.value}>")
