"""The Store contract, and the small pieces of glue the backends share (fencing parameters,
the not-current refusal). Validators and codecs are ``lease_celery.checks``; URL options
``stores.urls``; the scheme registry and ``open_store`` ``stores.registry``.

A store is the only code that talks to a database. Each mutation is one conditional write
whose condition is evaluated by the store, on the store's clock, inside the same transaction as
the write; a refused write changes nothing.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from ..checks import check_key, check_ttl
from ..errors import (
    LeaseLost,
    StoreError,
)
from ..models import (
    EffectState,
    HistoryEntry,
    Lease,
    LeaseRecord,
    LeaseState,
    Receipt,
    StoreStats,
)

if TYPE_CHECKING:
    from ..effects import Effects

__all__ = ["DEFAULT_SWEEP_GRACE", "PURGE_BATCH", "Clock", "Store", "fence_params",
           "lease_not_current", "lease_params", "settle_deadline_offset"]

Clock = Callable[[], float]


#: Seconds a sweep leaves a row it re-published alone (and a ready row unclaimed before it is
#: re-published): at most one re-publish per row per grace period.
DEFAULT_SWEEP_GRACE = 60.0

#: Rows one purge transaction removes at most (retention prunes in batches of this size).
#: Small on purpose: at a million rows, 500 random-key deletes held SQLite's only write lock
#: for ~20 ms (claims behind it stalled up to 45 ms); 100 hold it ~3 ms.
PURGE_BATCH = 100


class Store(abc.ABC):
    """A lease store.

    Refusals are falsy returns, never exceptions: ``claim`` and ``renew`` return ``None``,
    ``finish`` and ``release`` return ``False``. Exceptions mean the store could not answer
    (``StoreError``) or the input is invalid (``ValueError`` subclasses); in both cases nothing
    was written.
    """

    url: str

    @abc.abstractmethod
    def __init__(self, url: str, *, clock: Clock | None = None) -> None:
        """Parse ``url`` (raising ``ConfigError`` naming the problem); connect lazily."""

    @classmethod
    def check_url(cls, url: str) -> None:
        """Refuse a malformed URL without touching files or servers (publishers run this too:
        a host that only sends tasks need not reach the store)."""
        cls(url).close()

    @abc.abstractmethod
    def claim(self, key: str, *, owner: str, ttl: float,
              task: Mapping[str, Any] | None = None) -> Lease | None:
        """Atomically take ``key`` for ``owner`` until store-now + ``ttl``.

        Succeeds when the key has no row, is ``ready`` and past its ``not_before``, or is
        ``running`` with ``expires_at <= now`` (a takeover: ``takeovers`` + 1). The token becomes
        the previous token + 1 (1 for a new key), ``attempts`` grows by one, ``not_before`` is
        cleared. ``task`` (JSON: name, id, args, kwargs, options) is recorded so the task can be
        re-published without its message. Returns ``None`` when a live lease holds the key, it is
        backing off, or it is ``done``/``dead``.
        """

    @abc.abstractmethod
    def renew(self, lease: Lease, *, ttl: float) -> Lease | None:
        """Move the deadline to store-now + ``ttl`` if ``lease`` is still current.

        Current means: state ``running``, same owner, same token and ``expires_at > now``, checked
        in the same transaction as the write. Returns the renewed lease or ``None``.
        """

    def renew_many(self, leases: Sequence[Lease], *, ttl: float) -> list[Lease | None]:
        """Renew several leases; the result lists each one's renewed lease or ``None``, in order.

        Each lease is judged on its own by the rule of :meth:`renew` (two leases of one key,
        an old and a new generation, get their own answers). Stores override this to renew
        all of them in one round trip.
        """
        return [self.renew(lease, ttl=ttl) for lease in leases]

    @abc.abstractmethod
    def finish(self, lease: Lease, result: Any = None, *,
               settle_within: float | None = None) -> bool:
        """Store ``result`` (JSON) and mark the key ``done`` if ``lease`` is still current.

        The fencing check (state, owner, token, ``expires_at > now``) and the write are one
        statement. Returns ``False`` and writes nothing when the lease is not current. A result
        that is not JSON raises ``ResultNotSerializable`` before anything is written.

        ``settle_within``: the key is done but *settling*: Celery has yet to store the outcome
        and send callbacks. ``expires_at`` becomes the settle deadline (now + settle_within),
        which the owner may ``renew``; the owner confirms with :meth:`settle`. Past the
        deadline unconfirmed, the owner is gone and a delivery completes the key
        (:meth:`claim_settlement`). Without it the key is settled at once.
        """

    def settle(self, lease: Lease) -> bool:
        """Confirm that the outcome ``lease`` finished (or killed) with has been stored by
        Celery: the settle phase ends. False when ``lease`` no longer settles the key (someone
        completed it meanwhile)."""
        return self.settle_many([lease])[0]

    @abc.abstractmethod
    def settle_many(self, leases: Sequence[Lease]) -> list[bool]:
        """:meth:`settle` for several leases in one round trip; answers in order.

        Each is one conditional write: the key is settling, with this owner and token. A
        settled done row drops its task info (it will never be re-published).
        """

    @abc.abstractmethod
    def claim_settlement(self, key: str, *, owner: str, ttl: float) -> Lease | None:
        """Take over the settle phase of ``key`` whose deadline passed unconfirmed.

        One conditional write: the key is settling and ``expires_at <= now``. The token stays
        (the outcome is that generation's); the owner becomes ``owner`` with a new settle
        deadline of now + ``ttl``, so exactly one delivery completes the key at a time. Returns
        the lease to settle, or ``None``.
        """

    @abc.abstractmethod
    def release(self, lease: Lease, *, delay: float = 0.0, reason: str | None = None) -> bool:
        """Give the key back early (state ``ready``) if ``lease`` is still current.

        The token is kept, so the next claim gets token + 1. A released lease can neither renew
        nor finish. ``delay`` > 0 sets ``not_before`` = now + delay (backoff); ``reason`` is
        recorded. Returns ``False`` when the lease was not current.
        """

    @abc.abstractmethod
    def kill(self, lease: Lease, *, reason: str, settle_within: float | None = None) -> bool:
        """Mark the key ``dead`` (terminal until requeued) if ``lease`` is still current.

        ``settle_within``: as for :meth:`finish`, the failure still has to reach Celery's
        result backend (and errbacks); the owner confirms with :meth:`settle`.
        """

    # -- operator actions: conditional on the row's state, not on a lease -------------------

    @abc.abstractmethod
    def checkpoint(self, lease: Lease, data: str) -> bool:
        """Fenced: store ``data`` (JSON text, see ``encode_checkpoint``) as the key's progress
        checkpoint if ``lease`` is still current; False (nothing written) otherwise. The
        checkpoint survives takeovers, retries and requeue; ``finish`` clears it."""

    @abc.abstractmethod
    def cancel(self, key: str, *, reason: str) -> bool:
        """An operator cancels ``key``, in one conditional write. A live holder is asked to
        stop: its next claim or renewal returns the reason (``Lease.cancel``), and it ends the
        key ``dead``. A key nobody holds (no row, ``ready``, an expired lease) goes ``dead``
        at once, so no delivery runs its body. False for a ``done`` or ``dead`` key. ``reason``
        is stored as ``cancelled: <reason>``; ``requeue`` brings the key back."""

    # -- history (lease_celery.history writes it, in batches, off the task's path) ----------

    @abc.abstractmethod
    def record_history_many(self, entries: Sequence[HistoryEntry]) -> None:
        """Append ``entries`` to their keys' histories (one write)."""

    def record_history(self, key: str, event: str, *, owner: str | None = None,
                       token: int | None = None, fence: int | None = None,
                       detail: str | None = None) -> None:
        """Append one event now (operator actions: ``detail`` says who and why)."""
        self.record_history_many([HistoryEntry(
            check_key(key), time.time(), event, owner, token, fence,
            None if detail is None else detail[:2000])])

    @abc.abstractmethod
    def history(self, key: str, *, limit: int = 100) -> list[HistoryEntry]:
        """The last ``limit`` events of ``key``, oldest first."""

    @abc.abstractmethod
    def recent_history(self, *, events: Sequence[str] | None = None,
                       limit: int = 100) -> list[HistoryEntry]:
        """The latest ``limit`` events across keys (only ``events``, if given), newest first."""

    @abc.abstractmethod
    def prune_history(self, seconds: float, *, limit: int = PURGE_BATCH * 10) -> int:
        """Delete up to ``limit`` history entries older than ``seconds``; how many went."""

    @abc.abstractmethod
    def force_release(self, key: str, *, reason: str) -> bool:
        """Make a ``running`` row ``ready`` whoever holds it (recorded in ``reason``).

        The holder's renew and finish then fail, so its result is refused.
        """

    @abc.abstractmethod
    def requeue(self, key: str, *, reason: str) -> LeaseRecord | None:
        """``dead`` → ``ready`` with attempts and takeovers reset; the token continues.

        Returns the updated record, or ``None`` if the key was not dead.
        """

    @abc.abstractmethod
    def find(self, *, state: LeaseState | None = None, prefix: str | None = None,
             owner: str | None = None, limit: int = 100) -> list[LeaseRecord]:
        """Rows matching every given filter, most recently updated first."""

    @abc.abstractmethod
    def stats(self) -> StoreStats:
        """Row counts by state, and how many running rows have expired."""

    @abc.abstractmethod
    def purge_older_than(self, seconds: float, *, limit: int | None = None) -> int:
        """Delete settled ``done``/``dead`` rows not updated for ``seconds``, oldest first, at
        most ``limit`` of them (None: all, in batches of ``PURGE_BATCH``, each its own short
        write); return how many. Tokens are retired: a key claimed again continues."""

    @abc.abstractmethod
    def sweep_unmark(self, key: str, token: int) -> bool:
        """Undo ``sweep_expired``'s mark on generation ``token`` (its re-publish failed): the
        next sweep returns the row again."""

    @abc.abstractmethod
    def sweep_expired(self, *, limit: int = 100,
                      grace: float = DEFAULT_SWEEP_GRACE) -> list[LeaseRecord]:
        """Mark and return the rows that carry task info and that nobody will run unless the
        task is re-published:

        - ``running`` with an expired lease (its owner died or stalled);
        - settling past the settle deadline (its owner died before confirming the outcome);
        - ``ready`` and claimable for ``grace`` seconds without a claim (its message is lost).

        The mark is a conditional write that leaves the row alone for ``grace`` seconds, so
        concurrent sweepers never return a row twice within a grace period, and a sweeper that
        dies between its mark and its re-publish leaves a mark that expires: the row is
        returned again a grace period later. Reads only rows that are not terminal.
        """

    @abc.abstractmethod
    def purge(self, key: str) -> bool:
        """Delete the row for ``key`` unless a live lease holds it; return whether it was deleted.

        The key's last token is kept apart, so a key claimed again after a purge continues at
        token + 1: tokens never restart. A running lease that has not expired is never deleted.
        """

    @abc.abstractmethod
    def get(self, key: str) -> LeaseRecord | None:
        """Return a snapshot of the row for ``key``, or ``None`` if there is none."""

    def settled_by(self, lease: Lease, state: LeaseState) -> bool:
        """Did ``lease`` itself move its key to ``state``? (Checked after a refusal.)

        A write whose reply was lost and that the driver then re-sent is refused the second
        time although the first one took effect. Only the holder of ``lease`` can settle the
        row with its own owner and token, so finding them there means the write was ours.
        """
        record = self.get(lease.key)
        return (record is not None and record.state is state and record.token == lease.token
                and record.owner == lease.owner)

    def fenced(self, lease: Lease) -> AbstractContextManager[Any]:
        """A transaction on the store's database in which ``lease`` is verified current.

        Yields a DB-API connection; the caller's own writes through it commit only if the lease
        is still current at commit, and raise ``LeaseLost`` (rolled back) otherwise. Only stores
        that share a database with the caller's rows offer it.
        """
        raise StoreError(f"{type(self).__name__} cannot run your writes in the lease's "
                         "transaction; use the PostgreSQL or SQLite store for fenced writes")

    # -- effect receipts: lease_celery.effects builds its logic on these five primitives ------

    @property
    def effects(self) -> Effects:
        """Idempotent receipts for outside actions, kept in this store (see ``Effects``)."""
        from ..effects import Effects

        effects: Effects | None = self.__dict__.get("_effects")
        if effects is None:
            effects = self.__dict__["_effects"] = Effects(self)
        return effects

    @abc.abstractmethod
    def effect_insert(self, key: str, fingerprint: str, lease: Lease | None) -> bool:
        """Create an ``in_flight`` receipt (version 1, attempts 1, started now) for ``lease``.

        Atomic insert-if-absent: returns False, changing nothing, if ``key`` has a receipt.
        Raises ``LeaseLost`` (nothing written) if ``lease`` is given and no longer current: a
        worker that stalled past its lease starts no new action.
        """

    @abc.abstractmethod
    def effect_get(self, key: str) -> Receipt | None:
        """Return the receipt for ``key``, or ``None``."""

    @abc.abstractmethod
    def effect_find(self, *, state: EffectState | None = None,
                    limit: int = 100) -> list[Receipt]:
        """Receipts (only those in ``state``, if given), most recently changed first."""

    @abc.abstractmethod
    def effect_update(self, key: str, *, version: int, state: EffectState,
                      result: str | None) -> bool:
        """Set ``state`` and ``result`` (JSON text or None) if the receipt is at ``version``.

        One conditional write; the version grows by one. False (nothing written) otherwise.
        """

    @abc.abstractmethod
    def effect_restart(self, key: str, *, version: int, lease: Lease | None) -> bool:
        """Start a new attempt: ``in_flight`` for ``lease``, attempts + 1, if at ``version``.

        Raises ``LeaseLost`` (nothing written) if ``lease`` is given and no longer current.
        """

    @abc.abstractmethod
    def effect_delete(self, key: str, *, version: int) -> bool:
        """Delete the receipt if it is at ``version``."""

    @abc.abstractmethod
    def now(self) -> float:
        """Return the store's current time (the authority clock), in epoch seconds."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release connections. The store reconnects if used again."""

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.url}>"


def fence_params(lease: Lease) -> dict[str, Any]:
    """The fencing predicate's parameters: the lease must still be this owner's, this token."""
    if not isinstance(lease, Lease):
        raise TypeError(f"expected a Lease, got {type(lease).__name__}: {lease!r}")
    return {"key": lease.key, "owner": lease.owner, "token": lease.token}


def lease_not_current(lease: Lease, when: str) -> LeaseLost:
    return LeaseLost(f"lease {lease.key!r} (owner {lease.owner}, token {lease.token}) is not "
                     f"current {when}; nothing was written")


def lease_params(lease: Lease | None) -> dict[str, Any]:
    """The columns that record which lease started an effect (all None without a lease)."""
    if lease is None:
        return {"lease_key": None, "lease_token": None, "lease_owner": None}
    return {"lease_key": lease.key, "lease_token": lease.token, "lease_owner": lease.owner}


def settle_deadline_offset(settle_within: float | None) -> float | None:
    """``settle_within`` checked (None: settle at once)."""
    return None if settle_within is None else check_ttl(settle_within, name="settle_within")


