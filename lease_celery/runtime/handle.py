"""LeaseHandle: the lease a running task holds, as the task body sees it (``self.lease``).

A read-only view of the :class:`~lease_celery.runtime.execution.Execution` that owns it: the
body reads the lease and asks whether it still holds; everything else belongs to the execution.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Protocol

from ..checks import encode_checkpoint
from ..errors import LeaseCancelled, LeaseError, LeaseLost
from ..models import Lease
from ..stores.base import Store

__all__ = ["LeaseHandle", "Owner"]


class Owner(Protocol):
    """What a handle reads of the execution that owns it (``runtime.execution.Execution``),
    typed here so that the execution, which makes its handle, is the only one of the two
    that imports the other."""

    @property
    def lease(self) -> Lease: ...

    @property
    def store(self) -> Store: ...

    @property
    def lost(self) -> str | None: ...

    @property
    def cancelled(self) -> str | None: ...

    @property
    def in_app_transaction(self) -> bool: ...

    def mark_lost(self, reason: str) -> bool: ...

    def transaction(self, connection: Any) -> AbstractContextManager[Any]: ...

_UNREAD: Any = object()  # checkpoint_data not read from the store yet


class LeaseHandle:
    """The current lease of one task execution, kept up to date by the heartbeat.

    A task body reads ``key``, ``owner``, ``token``, ``expires_at``, ``fence``, ``attempts``
    and ``takeovers``, calls ``check()`` between steps, ``checkpoint()`` /
    ``checkpoint_data`` for long work, and ``fenced()`` / ``effect()`` for fenced writes and
    outside actions; ``lost`` and ``cancelled`` say, without raising, what ``check()`` would
    raise for.

    ``check()`` raises :class:`LeaseLost` once the lease is known lost: a renewal was refused, or
    no renewal succeeded before the deadline (measured on this process's monotonic clock from the
    moment the last successful request was *sent*, so it never outlives the store's deadline).
    """

    def __init__(self, execution: Owner) -> None:
        self._execution = execution
        # The key's checkpoint as this execution knows it: unread (_UNREAD) until asked for.
        self._checkpoint: Any = _UNREAD

    @property
    def key(self) -> str:
        """The lease key (the task's ``lease_key`` filled in with its arguments)."""
        return self._execution.lease.key

    @property
    def owner(self) -> str:
        """This execution as the store knows it (``hostname:pid:uuid4/n`` in a worker)."""
        return self._execution.lease.owner

    @property
    def token(self) -> int:
        """This claim's generation on the key: +1 per successful claim, never reused."""
        return self._execution.lease.token

    @property
    def expires_at(self) -> float:
        """When the store lets the lease go unless renewed (epoch seconds, the store's clock;
        moved on by each accepted renewal)."""
        return self._execution.lease.expires_at

    @property
    def fence(self) -> int:
        """The store-wide fence of this claim, for a resource's ``FenceGate``."""
        return self._execution.lease.fence

    @property
    def attempts(self) -> int:
        """How many claims of the key counted as attempts, this one included (a Celery retry
        or a ``replace()`` gives its attempt back: it is the task's own control flow)."""
        return self._execution.lease.attempts

    @property
    def takeovers(self) -> int:
        """How many claims of the key found the previous owner's lease expired."""
        return self._execution.lease.takeovers

    @property
    def lost(self) -> str | None:
        """Why the lease is lost once this execution may no longer hold it (a renewal or a
        write refused, or no renewal succeeded before the deadline); None while it holds.
        An operator's cancel is :attr:`cancelled`; ``check()`` raises for either."""
        return self._execution.lost

    @property
    def cancelled(self) -> str | None:
        """``cancelled: …`` once an operator cancelled the key (seen at the claim or a renewal,
        so within one heartbeat interval of ``celery leases cancel``); None otherwise."""
        return self._execution.cancelled

    def check(self) -> None:
        """Raise :class:`LeaseLost` if this execution may no longer hold the lease, and
        :class:`LeaseCancelled` (a ``LeaseLost``) once an operator cancelled the key."""
        cancelled = self.cancelled
        if cancelled is not None:
            raise LeaseCancelled(f"lease {self.key!r} (token {self.token}) was {cancelled}; "
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
        execution = self._execution
        self._outside_app_transaction("checkpoint()")
        if not execution.store.checkpoint(execution.lease, encoded):
            reason = "checkpoint refused: the lease expired or was taken over"
            execution.mark_lost(reason)
            raise LeaseLost(f"lease {self.key!r} (owner {self.owner}, token {self.token}) "
                            f"is lost: {reason}; stop the protected work")
        self._checkpoint = json.loads(encoded)  # what a reader of the row gets back

    @property
    def checkpoint_data(self) -> Any:
        """The key's latest checkpoint: this execution's last one, else what a previous
        generation left (read from the store once), or None on a fresh key."""
        if self._checkpoint is _UNREAD:
            record = self._execution.store.get(self.key)
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
        self._outside_app_transaction("fenced()")
        return self._execution.store.fenced(self._execution.lease)

    def transaction(self, connection: Any) -> AbstractContextManager[Any]:
        """Complete the task in the app's own transaction: its rows and the key's finish in
        one commit.

        ``connection`` is the app's: a psycopg 3 or ``sqlite3`` connection, or a SQLAlchemy
        ``Connection`` or ``Session``, to the database the lease store lives in (the same
        PostgreSQL database, the same SQLite file)::

            with self.lease.transaction(conn) as tx:
                conn.execute("INSERT INTO payments ...")
                return tx.complete(receipt)   # the key's result

        On entry the lease is verified current under a lock on the key's row, in that
        transaction (opened here unless one is open). On leaving, the finish and its history
        entry are written in it, fenced again, and the transaction is committed if it was
        opened here. A lease no longer current rolls the block back whole with ``LeaseLost``;
        an exception rolls it back and takes its usual way. After the commit the outcome is
        decided: a redelivery is answered from the row, and the body never runs again. Keep
        the block short: the row lock holds off this key's renewals until it ends.
        """
        self.check()
        return self._execution.transaction(connection)

    def _outside_app_transaction(self, what: str) -> None:
        if self._execution.in_app_transaction:
            raise LeaseError(f"lease {self.key!r}: {what} inside lease.transaction() would wait "
                             "for the row lock that transaction holds; call it before the "
                             "block, or write through the block's connection")

    def effect(self, key: str, payload: Any, fn: Callable[[str], Any], *,
               retry_same_key: bool = False, wait: float = 0.0) -> Any:
        """Perform an outside action at most once per business ``key`` (see ``Effects.once``).

        Checks the lease first: a worker that lost its lease does not start new actions.
        """
        self.check()
        return self._execution.store.effects.once(
            key, payload, fn, lease=self._execution.lease, retry_same_key=retry_same_key,
            wait=wait)

    def __repr__(self) -> str:
        lost = self.lost
        state = "held" if lost is None else f"lost: {lost}"
        return f"<LeaseHandle {self.key!r} token={self.token} owner={self.owner} {state}>"
