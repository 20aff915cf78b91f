"""The Store contract, and the small pieces of glue the backends share (fencing parameters,
the not-current refusal). Validators and codecs are ``lease_celery.checks``; URL options
``stores.urls``; the scheme registry and ``open_store`` ``stores.registry``.

A store is the only code that talks to a database. Each mutation is one conditional write
whose condition is evaluated by the store, on the store's clock, inside the same transaction as
the write; a refused write changes nothing.
"""

from __future__ import annotations

import abc
import dataclasses
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, ClassVar

from ..app_connections import AppConnection
from ..checks import (
    cancel_reason,
    check_delay,
    check_key,
    check_owner,
    check_page_size,
    check_ttl,
    decode_task,
    encode_result,
    encode_task,
)
from ..effects import Effects
from ..errors import (
    ConfigError,
    LeaseLost,
    StoreDataLost,
    StoreError,
)
from ..limits import (
    GroupLimit,
    LimitGroup,
    LimitRefused,
    Rate,
    Waiter,
    check_concurrency,
    check_group_limit,
    parse_rate,
)
from ..models import (
    EffectState,
    EpochReset,
    Finding,
    HistoryEntry,
    Lease,
    LeaseRecord,
    LeaseState,
    Receipt,
    StoreEpoch,
    StoreStats,
)
from .rows import Row, lease_of, receipt_of, record_of

#: The key ``diagnose`` reads (lease_celery's own namespace: no task's key).
DIAGNOSE_KEY = "lease_celery:doctor"
#: Seconds the store's clock and this host's may differ before ``diagnose`` says so.
CLOCK_TOLERANCE = 2.0

__all__ = ["DEFAULT_SWEEP_GRACE", "PURGE_BATCH", "Clock", "Row", "Store", "check_lease",
           "effective_interval", "effective_limit", "fence_params", "group_verdict",
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

    The public methods are written here, once: they check and encode what they are given,
    call one primitive of the backend, and turn its rows into values (``stores.rows``). A
    backend provides the primitives (the ``_``-prefixed abstract methods below: the
    conditional writes and the reads), each handed checked, encoded arguments; it validates
    nothing of its own.
    """

    url: str
    #: Whether :meth:`finish_and_claim` is one transaction here (one commit or one script, one
    #: round trip): then a short task's finish behind the return is best carried by the next
    #: claim. A store that sends the two writes in turn saves nothing by it.
    carries_finish: ClassVar[bool] = False

    @abc.abstractmethod
    def __init__(self, url: str, *, clock: Clock | None = None) -> None:
        """Parse ``url`` (raising ``ConfigError`` naming the problem); connect lazily."""

    @classmethod
    def check_url(cls, url: str) -> None:
        """Refuse a malformed URL without touching files or servers (publishers run this too:
        a host that only sends tasks need not reach the store)."""
        cls(url).close()

    # -- the lease's life -------------------------------------------------------------------

    def claim(self, key: str, *, owner: str, ttl: float,
              task: Mapping[str, Any] | None = None) -> Lease | None:
        """Atomically take ``key`` for ``owner`` until store-now + ``ttl``.

        Succeeds when the key has no row, is ``ready`` and past its ``not_before``, or is
        ``running`` with ``expires_at <= now`` (a takeover: ``takeovers`` + 1). The token becomes
        the previous token + 1 (for a new key 1, or on Redis the epoch's floor + 1: see
        ``epoch``), ``attempts`` grows by one, ``not_before`` is cleared. ``task`` (JSON: name,
        id, args, kwargs, options) is recorded so the task can be re-published without its
        message. Returns ``None`` when a live lease holds the key, it is
        backing off, or it is ``done``/``dead``.
        """
        key, owner, ttl = check_key(key), check_owner(owner), check_ttl(ttl)
        row = self._claim(key, owner, ttl, encode_task(task))
        return None if row is None else lease_of(key, owner, row)

    def record_published(self, key: str, *, task: Mapping[str, Any],
                         countdown: float = 0.0) -> bool:
        """A task is about to be published: write the row of ``key`` as ``ready`` with
        ``task`` (the message's task info), unless the key has a row; return whether it was
        written. One conditional write: of two publishers at once, one writes.

        The row is claimable at once (its token and attempts unchanged: the first claim is
        token + 1, attempt 1). The sweeper re-publishes it if nobody claims it ``grace``
        seconds after ``countdown`` (the message's) has passed, as any ready row: a message
        the broker lost before anyone claimed it is not lost for good.
        """
        key = check_key(key)
        encoded = encode_task(task)
        if encoded is None:
            raise ValueError(f"lease {key!r}: the task info cannot be recorded at publish "
                             f"(it is not JSON: {type(task).__name__} with arguments kombu's "
                             f"JSON cannot encode)")
        return self._record_published(key, encoded,
                                      check_delay(countdown, name="countdown"))

    def renew(self, lease: Lease, *, ttl: float) -> Lease | None:
        """Move the deadline to store-now + ``ttl`` if ``lease`` is still current.

        Current means: state ``running``, same owner, same token and ``expires_at > now``, checked
        in the same transaction as the write. Returns the renewed lease or ``None``.
        """
        return self.renew_many([lease], ttl=ttl)[0]

    def renew_many(self, leases: Sequence[Lease], *, ttl: float) -> list[Lease | None]:
        """Renew several leases in one round trip; the result lists each one's renewed lease
        or ``None``, in order.

        Each lease is judged on its own by the rule of :meth:`renew` (two leases of one key,
        an old and a new generation, get their own answers).
        """
        ttl = check_ttl(ttl)
        leases = [check_lease(lease) for lease in leases]
        if not leases:
            return []
        rows = self._renew_many(leases, ttl)
        return [None if row is None else dataclasses.replace(
                    lease, expires_at=float(row["expires_at"]), cancel=row.get("cancel") or None)
                for lease, row in zip(leases, rows, strict=True)]

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
        lease = check_lease(lease)
        encoded = encode_result(result)  # before any write: a bad result writes nothing
        return self._finish(lease, encoded, settle_deadline_offset(settle_within))

    def finish_and_claim(self, finished: Lease, result: Any, key: str, *, owner: str,
                         ttl: float, task: Mapping[str, Any] | None = None
                         ) -> tuple[bool, Lease | None]:
        """:meth:`finish` of ``finished`` (settled at once) and :meth:`claim` of ``key``: the
        previous delivery's finish carried by the next one's claim, in one transaction where
        the store has one (one commit, one round trip instead of two of each).

        Each is judged by its own rule, exactly as if sent alone: the finish is fenced on
        ``finished``, the claim succeeds or is refused on ``key``'s row. Returns whether the
        finish was accepted and the claimed lease (None when refused). A result that is not
        JSON raises ``ResultNotSerializable`` before anything is written. On the same key the
        finish is written first, then the claim (which then finds the key done).
        """
        finished = check_lease(finished)
        encoded = encode_result(result)
        key, owner, ttl = check_key(key), check_owner(owner), check_ttl(ttl)
        encoded_task = encode_task(task)
        if finished.key == key:
            # One statement may not write one row twice (PostgreSQL refuses it): the
            # contract's default, the two writes in turn.
            accepted, row = Store._finish_and_claim(self, finished, encoded, key, owner, ttl,
                                                    encoded_task)
        else:
            accepted, row = self._finish_and_claim(finished, encoded, key, owner, ttl,
                                                   encoded_task)
        return accepted, None if row is None else lease_of(key, owner, row)

    def settle(self, lease: Lease) -> bool:
        """Confirm that the outcome ``lease`` finished (or killed) with has been stored by
        Celery: the settle phase ends. False when ``lease`` no longer settles the key (someone
        completed it meanwhile)."""
        return self.settle_many([lease])[0]

    def settle_many(self, leases: Sequence[Lease]) -> list[bool]:
        """:meth:`settle` for several leases in one round trip; answers in order.

        Each is one conditional write: the key is settling, with this owner and token. A
        settled done row drops its task info (it will never be re-published).
        """
        leases = [check_lease(lease) for lease in leases]
        return self._settle_many(leases) if leases else []

    def claim_settlement(self, key: str, *, owner: str, ttl: float) -> Lease | None:
        """Take over the settle phase of ``key`` whose deadline passed unconfirmed.

        One conditional write: the key is settling and ``expires_at <= now``. The token stays
        (the outcome is that generation's); the owner becomes ``owner`` with a new settle
        deadline of now + ``ttl``, so exactly one delivery completes the key at a time. Returns
        the lease to settle, or ``None``.
        """
        key, owner, ttl = check_key(key), check_owner(owner), check_ttl(ttl)
        row = self._claim_settlement(key, owner, ttl)
        return None if row is None else dataclasses.replace(lease_of(key, owner, row),
                                                            cancel=None)

    def release(self, lease: Lease, *, delay: float = 0.0, reason: str | None = None,
                task: Mapping[str, Any] | None = None, counted: bool = True) -> bool:
        """Give the key back early (state ``ready``) if ``lease`` is still current.

        The token is kept, so the next claim gets token + 1. A released lease can neither renew
        nor finish. ``delay`` > 0 sets ``not_before`` = now + delay (backoff, or when a retry
        is due); ``reason`` is recorded. ``task``, when given, replaces the row's task info
        in the same write: the message that will claim the key next (a retry's, a
        replacement's), which the sweeper re-publishes if it is lost. ``counted=False`` gives
        the attempt back (``attempts`` - 1): the claim ended in the task's own control flow
        (a Celery retry, a ``replace()``), not in a failure of the lease's. Returns ``False``
        when the lease was not current.
        """
        return self._release(check_lease(lease), check_delay(delay), reason,
                             encode_task(task), bool(counted))

    def kill(self, lease: Lease, *, reason: str, settle_within: float | None = None,
             error: Any = None) -> bool:
        """Mark the key ``dead`` (terminal until requeued) if ``lease`` is still current.

        ``settle_within``: as for :meth:`finish`, the failure still has to reach Celery's
        result backend (and errbacks); the owner confirms with :meth:`settle`. ``error``: the
        exception that failed the task as Celery stores one (JSON-able), kept as the dead
        row's ``result``: a delivery answered with this outcome fails with that exception.
        """
        encoded = None if error is None else encode_result(error)  # before any write
        return self._kill(check_lease(lease), reason, settle_deadline_offset(settle_within),
                          encoded)

    def checkpoint(self, lease: Lease, data: str) -> bool:
        """Fenced: store ``data`` (JSON text, see ``encode_checkpoint``) as the key's progress
        checkpoint if ``lease`` is still current; False (nothing written) otherwise. The
        checkpoint survives takeovers, retries and requeue; ``finish`` clears it."""
        return self._checkpoint(check_lease(lease), str(data))

    # -- key-group limits (lease_celery.limits) ---------------------------------------------

    def claim_limited(self, key: str, *, owner: str, ttl: float, limit: GroupLimit,
                      task: Mapping[str, Any] | None = None) -> Lease | LimitRefused | None:
        """:meth:`claim` ``key`` and a slot of its group in one conditional write, on the
        store's clock.

        ``None``: the key itself is not claimable (as :meth:`claim`; a waiter entry the key
        had is dropped). Otherwise the group decides, by the limit and rate in force (an
        operator's, :meth:`set_limit`, else ``limit``'s, which the group's row records):

        - over the limit (:func:`group_verdict`): refused, and, with ``task``, parked as the
          group's waiter (once per key, in arrival order; a waiter handed on and refused
          again keeps its place) until :meth:`hand_on` returns it;
        - under it but before the group's next allowed start: refused with ``retry_at``;
        - else granted: the lease carries the group and its slot token (the group's grants
          so far), the next allowed start moves one interval on, the key's waiter entry goes.

        The slot is the lease: renewed with it, freed by its finish, release or death, and by
        its expiry (a stalled holder's finish is refused as any expired lease's).
        """
        key, owner, ttl = check_key(key), check_owner(owner), check_ttl(ttl)
        limit = check_group_limit(limit)
        row = self._claim_limited(key, owner, ttl, encode_task(task), check_key(limit.group),
                                  limit.limit, limit.rate)
        if row is None:
            return None
        if row.get("verdict") in ("limit", "rate"):
            retry_at = row.get("retry_at")
            return LimitRefused(
                group=limit.group, reason=str(row["verdict"]),
                parked=row["verdict"] == "limit" and task is not None,
                waiting=int(row.get("waiting") or 0), running=int(row.get("running") or 0),
                limit=None if row.get("lim") in (None, "") else int(row["lim"]),
                retry_at=None if retry_at in (None, "") else float(retry_at))
        return lease_of(key, owner, {**row, "grp": limit.group})

    def hand_on(self, group: str | None = None, *, grace: float = DEFAULT_SWEEP_GRACE,
                limit: int = 100) -> list[Waiter]:
        """The waiters to publish again now: in ``group`` (None: every group with waiters),
        the first ones in arrival order for which a slot is free (all of them once the limit
        is lifted), except those handed on less than ``grace`` seconds ago (their message is
        on its way). One conditional write marks them handed. Called by the worker whose
        finish, release or death freed a slot, right after its write, by the sweeper (a dead
        holder frees its slot by expiring), and after an operator raised a limit."""
        rows = self._hand_on(None if group is None else check_key(group),
                             check_delay(grace, name="grace"), check_page_size(limit))
        return [Waiter(group=str(row["grp"]), key=str(row["key"]),
                       task=decode_task(row.get("task") or None), since=float(row["since"]))
                for row in rows]

    def set_limit(self, group: str, *, concurrency: int | bool | None = None,
                  rate: Rate | str | bool | None = None, reset: bool = False) -> LimitGroup:
        """An operator's limit and rate for ``group``, overriding its tasks' until reset:
        ``concurrency`` (how many of the group may run at once) a number, or False to lift
        it (None: unchanged); ``rate`` as
        ``lease_rate_limit`` takes it, or False to lift it; ``reset``: back to the tasks'
        own. Returns the group as it is now. Waiters a raised limit lets run are handed on by
        :meth:`hand_on` (``celery leases limit`` does it at once)."""
        group = check_key(group)
        changes: dict[str, Any] = {}
        if reset:
            changes.update(set_limit=None, set_rate=None, set_interval=None)
        if concurrency is False:
            changes["set_limit"] = 0
        elif concurrency is not None and concurrency is not True:
            changes["set_limit"] = check_concurrency(concurrency, name="concurrency limit")
        elif concurrency is True:
            raise ConfigError("concurrency limit must be a whole number >= 1, or False to lift it")
        if rate is False:
            changes.update(set_rate="", set_interval=0.0)
        elif rate is not None and rate is not True:
            parsed = parse_rate(rate, name="rate")
            changes.update(set_rate=parsed.text, set_interval=parsed.interval)
        elif rate is True:
            raise ConfigError("rate must be a rate such as '10/s', or False to lift it")
        if not changes:
            raise ConfigError(f"limit group {group!r}: give a limit, a rate, or reset")
        self._set_limit(group, changes)
        found = self.limit_group(group)
        assert found is not None, "the group's row was just written"
        return found

    def limits(self, *, limit: int = 100) -> list[LimitGroup]:
        """The groups the store knows (by name), each with its limit, rate, running and
        waiting counts now."""
        return [_limit_group_of(row) for row in self._limits(None, check_page_size(limit))]

    def limit_group(self, group: str) -> LimitGroup | None:
        """One group as :meth:`limits` lists it, or None if the store never saw it."""
        rows = self._limits(check_key(group), 1)
        return _limit_group_of(rows[0]) if rows else None

    # -- operator actions: conditional on the row's state, not on a lease -------------------

    def cancel(self, key: str, *, reason: str) -> bool:
        """An operator cancels ``key``, in one conditional write. A live holder is asked to
        stop: its next claim or renewal returns the reason (``Lease.cancel``), and it ends the
        key ``dead``. A key nobody holds (no row, ``ready``, an expired lease) goes ``dead``
        at once, so no delivery runs its body. False for a ``done`` or ``dead`` key. ``reason``
        is stored as ``cancelled: <reason>``; ``requeue`` brings the key back."""
        return self._cancel(check_key(key), cancel_reason(reason))

    def force_release(self, key: str, *, reason: str) -> bool:
        """Make a ``running`` row ``ready`` whoever holds it (recorded in ``reason``).

        The holder's renew and finish then fail, so its result is refused.
        """
        return self._force_release(check_key(key), reason)

    def requeue(self, key: str, *, reason: str) -> LeaseRecord | None:
        """``dead`` → ``ready`` with attempts and takeovers reset; the token continues.

        Returns the updated record, or ``None`` if the key was not dead.
        """
        key = check_key(key)
        return self.get(key) if self._requeue(key, reason) else None

    def purge(self, key: str) -> bool:
        """Delete the row for ``key`` unless a live lease holds it; return whether it was deleted.

        The key's last token is kept apart, so a key claimed again after a purge continues at
        token + 1: tokens never restart. A running lease that has not expired is never deleted.
        """
        return self._purge(check_key(key))

    def purge_older_than(self, seconds: float, *, limit: int | None = None) -> int:
        """Delete settled ``done``/``dead`` rows not updated for ``seconds``, oldest first, at
        most ``limit`` of them (None: all, in batches of ``PURGE_BATCH``, each its own short
        write); return how many. Tokens are retired: a key claimed again continues."""
        return self._purge_older_than(check_delay(seconds),
                                      None if limit is None else check_page_size(limit))

    # -- reads ------------------------------------------------------------------------------

    def get(self, key: str) -> LeaseRecord | None:
        """Return a snapshot of the row for ``key``, or ``None`` if there is none."""
        row = self._get(check_key(key))
        return None if row is None else record_of(row)

    def find(self, *, state: LeaseState | None = None, prefix: str | None = None,
             owner: str | None = None, limit: int = 100) -> list[LeaseRecord]:
        """Rows matching every given filter, most recently updated first."""
        rows = self._find(None if state is None else LeaseState(state), prefix, owner,
                          check_page_size(limit))
        return [record_of(row) for row in rows]

    def stats(self) -> StoreStats:
        """Row counts by state, and how many running rows have expired."""
        rows = self._stats()
        return StoreStats(counts={str(row["state"]): int(row["total"]) for row in rows},
                          expired=sum(int(row["expired"] or 0) for row in rows))

    def settled_by(self, lease: Lease, state: LeaseState) -> bool:
        """Did ``lease`` itself move its key to ``state``? (Checked after a refusal.)

        A write whose reply was lost and that the driver then re-sent is refused the second
        time although the first one took effect. Only the holder of ``lease`` can settle the
        row with its own owner and token, so finding them there means the write was ours.
        """
        record = self.get(lease.key)
        return (record is not None and record.state is state
                and record.held_by(lease.owner, lease.token))

    # -- the sweeper's ----------------------------------------------------------------------

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
        keys = self._sweep_expired(check_page_size(limit), check_delay(grace, name="grace"),
                                   uuid.uuid4().hex)
        return [record for key in keys if (record := self.get(key)) is not None]

    def sweep_unmark(self, key: str, token: int) -> bool:
        """Undo ``sweep_expired``'s mark on generation ``token`` (its re-publish failed): the
        next sweep returns the row again."""
        return self._sweep_unmark(check_key(key), int(token))

    # -- history (lease_celery.runtime.history writes it, in batches, off the task's path) --

    def record_history_many(self, entries: Sequence[HistoryEntry]) -> None:
        """Append ``entries`` to their keys' histories (one write)."""
        if entries:
            self._record_history_many(list(entries))

    def record_history(self, key: str, event: str, *, owner: str | None = None,
                       token: int | None = None, fence: int | None = None,
                       detail: str | None = None) -> None:
        """Append one event now (operator actions: ``detail`` says who and why)."""
        self.record_history_many([HistoryEntry(
            check_key(key), time.time(), event, owner, token, fence,
            None if detail is None else detail[:2000])])

    def history(self, key: str, *, limit: int = 100) -> list[HistoryEntry]:
        """The last ``limit`` events of ``key``, oldest first."""
        return self._history(check_key(key), check_page_size(limit))

    def history_many(self, keys: Sequence[str], *,
                     limit: int = 100) -> dict[str, list[HistoryEntry]]:
        """:meth:`history` of each of ``keys`` in one read: ``{key: its last limit events,
        oldest first}``, ``[]`` for a key without events."""
        wanted = sorted({check_key(key) for key in keys})
        if not wanted:
            return {}
        found = self._history_many(wanted, check_page_size(limit))
        return {key: found.get(key, []) for key in wanted}

    def recent_history(self, *, events: Sequence[str] | None = None,
                       limit: int = 100) -> list[HistoryEntry]:
        """The latest ``limit`` events across keys (only ``events``, if given), newest first."""
        return self._recent_history(None if events is None else list(events),
                                    check_page_size(limit))

    def prune_history(self, seconds: float, *, limit: int = PURGE_BATCH * 10) -> int:
        """Delete up to ``limit`` history entries older than ``seconds``; how many went."""
        # Entries carry the clock of the process that saw them: so does the cutoff.
        return self._prune_history(time.time() - check_delay(seconds), check_page_size(limit))

    # -- fenced writes of the caller's own --------------------------------------------------

    def fenced(self, lease: Lease) -> AbstractContextManager[Any]:
        """A transaction on the store's database in which ``lease`` is verified current.

        Yields a DB-API connection; the caller's own writes through it commit only if the lease
        is still current at commit, and raise ``LeaseLost`` (rolled back) otherwise. Only stores
        that share a database with the caller's rows offer it.
        """
        raise StoreError(f"{type(self).__name__} cannot run your writes in the lease's "
                         "transaction; use the PostgreSQL or SQLite store for fenced writes")

    # -- writes in the app's own transaction (lease_celery.app_connections) -------------------

    def lock_in(self, conn: AppConnection, lease: Lease, *, when: str) -> None:
        """Verify ``lease`` current inside ``conn``'s open transaction, and lock its row there
        until that transaction ends: no claim can take the key over meanwhile. ``LeaseLost``
        (``when`` says at which point) otherwise; ``ConfigError`` when ``conn`` is not a
        connection to this store's own database."""
        lease = check_lease(lease)
        self._check_app_database(conn)
        if not self._app_lock(conn, lease):
            raise lease_not_current(lease, when, what="committed")

    def finish_in(self, conn: AppConnection, lease: Lease, result: Any = None, *,
                  settle_within: float | None = None) -> bool:
        """:meth:`finish`, written in ``conn``'s open transaction (its history entry too): it
        commits with the caller's own rows or not at all. False when ``lease`` is not current."""
        lease = check_lease(lease)
        encoded = encode_result(result)
        self._check_app_database(conn)
        return self._app_finish(conn, lease, encoded, settle_deadline_offset(settle_within))

    def record_published_in(self, conn: AppConnection, key: str, *, task: Mapping[str, Any],
                            countdown: float = 0.0) -> bool:
        """:meth:`record_published`, written in ``conn``'s open transaction: the row exists
        if, and when, the caller's transaction commits (the row is the message's outbox)."""
        key = check_key(key)
        encoded = encode_task(task)
        if encoded is None:
            raise ValueError(f"lease {key!r}: the task info cannot be recorded in the "
                             f"transaction (it is not JSON: {type(task).__name__})")
        self._check_app_database(conn)
        return self._app_record_published(conn, key, encoded,
                                          check_delay(countdown, name="countdown"))

    # -- effect receipts: lease_celery.effects builds its logic on these ----------------------

    @property
    def effects(self) -> Effects:
        """Idempotent receipts for outside actions, kept in this store (see ``Effects``)."""
        effects: Effects | None = self.__dict__.get("_effects")
        if effects is None:
            effects = self.__dict__["_effects"] = Effects(self)
        return effects

    def effect_insert(self, key: str, fingerprint: str, lease: Lease | None) -> bool:
        """Create an ``in_flight`` receipt (version 1, attempts 1, started now) for ``lease``.

        Atomic insert-if-absent: returns False, changing nothing, if ``key`` has a receipt.
        Raises ``LeaseLost`` (nothing written) if ``lease`` is given and no longer current: a
        worker that stalled past its lease starts no new action.
        """
        lease = None if lease is None else check_lease(lease)
        return _effect_started(self._effect_insert(check_key(key), str(fingerprint), lease),
                               lease)

    def effect_restart(self, key: str, *, version: int, lease: Lease | None) -> bool:
        """Start a new attempt: ``in_flight`` for ``lease``, attempts + 1, if at ``version``.

        Raises ``LeaseLost`` (nothing written) if ``lease`` is given and no longer current.
        """
        lease = None if lease is None else check_lease(lease)
        return _effect_started(self._effect_restart(check_key(key), int(version), lease), lease)

    def effect_get(self, key: str) -> Receipt | None:
        """Return the receipt for ``key``, or ``None``."""
        row = self._effect_get(check_key(key))
        return None if row is None else receipt_of(row)

    def effect_find(self, *, state: EffectState | None = None,
                    limit: int = 100) -> list[Receipt]:
        """Receipts (only those in ``state``, if given), most recently changed first."""
        rows = self._effect_find(None if state is None else EffectState(state),
                                 check_page_size(limit))
        return [receipt_of(row) for row in rows]

    def effect_update(self, key: str, *, version: int, state: EffectState,
                      result: str | None) -> bool:
        """Set ``state`` and ``result`` (JSON text or None) if the receipt is at ``version``.

        One conditional write; the version grows by one. False (nothing written) otherwise.
        """
        return self._effect_update(check_key(key), int(version), EffectState(state), result)

    def effect_delete(self, key: str, *, version: int) -> bool:
        """Delete the receipt if it is at ``version``."""
        return self._effect_delete(check_key(key), int(version))

    # -- the store's epoch (what a server that lost its data is caught by) -----------------

    def epoch(self) -> StoreEpoch | None:
        """The store's epoch record; None for a store that keeps none.

        The SQL stores keep none: their rows live in the database's own transactions, and a
        restart keeps every write they acknowledged. The Redis store keeps one, because a Redis
        server restarted without persistence, or failed over to a replica that lagged, comes
        back without writes it acknowledged (see ``RedisStore``).
        """
        return None

    def reset_epoch(self) -> EpochReset:
        """Start a new epoch after a data loss, accepting it (``StoreDataLost`` until then).

        Tokens and fence numbers continue above every number handed out before. What was
        lost stays lost: a key whose row vanished is granted to its next delivery, and an
        effect whose receipt vanished may be sent again.
        """
        raise ConfigError(f"the {type(self).__name__} keeps no epoch: its database keeps every "
                          "write it acknowledged, and there is nothing to reset")

    # -- what the store says about itself (``celery leases doctor``) ------------------------

    def diagnose(self) -> list[Finding]:
        """What this store says about the promises it keeps, as doctor's findings: the
        backend's own (``_diagnose``: durability, eviction, replicas, where its file lives),
        whether its epoch holds, and its clock against this host's. Doctor prints them as
        they are, whatever the backend.

        It reads first (connection, schema migrated or refused, file format): a store that
        cannot be used raises its error (``LeaseError``), which doctor reports."""
        self.get(DIAGNOSE_KEY)
        return [*self._epoch_findings(), *self._diagnose(), *self._clock_findings()]

    def _diagnose(self) -> list[Finding]:
        """The backend's own findings about its server or file (none unless it has some).
        Never raises for what it could not check: that is a finding too."""
        return []

    def _epoch_findings(self) -> list[Finding]:
        """Opening the epoch (as any first use does) says whether the store lost its data;
        nothing for a store that keeps no epoch."""
        try:
            epoch = self.epoch()
        except StoreDataLost as exc:
            return [Finding("store.data_lost", "error", "ownership", str(exc))]
        if epoch is None:
            return []
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(epoch.created_at))
        return [Finding("store.epoch", "ok", "ownership",
                        f"the lease store's epoch {epoch.id} (since {when}) is in place: a "
                        "server that lost everything since then would have lost it too")]

    def _clock_findings(self) -> list[Finding]:
        """The store's clock against this host's: leases are judged on the store's alone,
        but history entries carry each process's time and the history is pruned by it."""
        try:
            offset = self.now() - time.time()
        except StoreDataLost:  # its own finding already; the clock waits for reset-epoch
            return []
        if abs(offset) <= CLOCK_TOLERANCE:
            return []
        side = "ahead of" if offset > 0 else "behind"
        return [Finding(
            "store.clock", "warning", "ownership",
            f"the lease store's clock is {abs(offset):.1f}s {side} this host's: leases are "
            "judged on the store's clock, so they hold, but the history's times are each "
            "process's and read out of order, and its retention prunes by this host's clock. "
            "Keep both in time (NTP)")]

    # -- the backend's primitives -----------------------------------------------------------
    # Each gets checked, encoded arguments and answers with rows (stores.rows) or booleans;
    # each write is one conditional write judged by the store, on the store's clock. All of
    # them raise StoreError (naming the server or file) when the store cannot answer.

    # The app-transaction primitives: only a store that can live in the app's database has
    # them; the others refuse with a reason the caller can act on.
    def _check_app_database(self, conn: AppConnection) -> None:
        raise ConfigError(f"the {type(self).__name__} cannot write in your database's "
                          "transaction: its data is not in your database. Use the PostgreSQL "
                          "or SQLite store in the app's own database (see docs/transactions.md)")

    def _app_lock(self, conn: AppConnection, lease: Lease) -> bool:
        raise NotImplementedError

    def _app_finish(self, conn: AppConnection, lease: Lease, result: str,
                    settle_within: float | None) -> bool:
        raise NotImplementedError

    def _app_record_published(self, conn: AppConnection, key: str, task: str,
                              countdown: float) -> bool:
        raise NotImplementedError

    @abc.abstractmethod
    def _claim(self, key: str, owner: str, ttl: float, task: str | None) -> Row | None:
        """The claim rule of :meth:`claim`; the claimed row (``token``, ``expires_at``,
        ``fence``, ``attempts``, ``takeovers``, ``cancel``) or None when refused."""

    def _finish_and_claim(self, finished: Lease, result: str, key: str, owner: str,
                          ttl: float, task: str | None) -> tuple[bool, Row | None]:
        """:meth:`_finish` (settled at once) of ``finished``, then :meth:`_claim` of another
        key; a store that can makes them one transaction. This default sends them one after
        the other, each atomic on its own (what a carried finish saves is then lost, nothing
        else)."""
        return self._finish(finished, result, None), self._claim(key, owner, ttl, task)

    @abc.abstractmethod
    def _claim_limited(self, key: str, owner: str, ttl: float, task: str | None, group: str,
                       limit: int | None, rate: Rate | None) -> Row | None:
        """The rule of :meth:`claim_limited`, in one transaction that holds the group (its
        claims are serialised) and reads the clock after taking it. The group's row records
        ``limit`` and ``rate`` (text and interval) as the task's. None: the key is not
        claimable (its waiter entry, if any, deleted). Else the row has ``verdict``:
        ``granted`` with the columns of :meth:`_claim` and ``slot``; ``limit`` (parked when
        ``task`` is not None) or ``rate``, with ``waiting``, ``running``, ``lim`` (the limit
        in force) and, for ``rate``, ``retry_at``. The verdict is :func:`group_verdict`'s."""

    @abc.abstractmethod
    def _hand_on(self, group: str | None, grace: float, limit: int) -> list[Row]:
        """The rule of :meth:`hand_on`: rows ``grp``, ``key``, ``task``, ``since`` of the
        waiters marked handed (``handed_at`` = now), at most ``limit``."""

    @abc.abstractmethod
    def _set_limit(self, group: str, changes: dict[str, Any]) -> None:
        """Create or update the group's row with ``changes`` (``set_limit``: None the task's,
        0 lifted; ``set_rate``/``set_interval``: None the task's, ''/0 lifted)."""

    @abc.abstractmethod
    def _limits(self, group: str | None, limit: int) -> list[Row]:
        """Group rows (only ``group`` if not None) by name: ``grp``, ``task_limit``,
        ``task_rate``, ``set_limit``, ``set_rate``, ``running``, ``waiting``,
        ``updated_at``."""

    @abc.abstractmethod
    def _record_published(self, key: str, task: str, countdown: float) -> bool:
        """Insert ``key`` as ``ready`` with ``task``, claimable now, due for the sweeper
        ``countdown`` seconds from now; nothing if a row exists (a purged key's tombstone
        counts as none, its token kept); return whether it was written."""

    @abc.abstractmethod
    def _renew_many(self, leases: Sequence[Lease], ttl: float) -> list[Row | None]:
        """For each lease (at least one), in order: the renewed ``expires_at`` and ``cancel``,
        or None when it was not current."""

    @abc.abstractmethod
    def _finish(self, lease: Lease, result: str, settle_within: float | None) -> bool:
        """Fenced: done with ``result`` (JSON text), settling until now + ``settle_within``
        unless that is None. False when the lease was not current."""

    @abc.abstractmethod
    def _release(self, lease: Lease, delay: float, reason: str | None, task: str | None,
                 counted: bool) -> bool:
        """Fenced: ready again, not before now + ``delay`` when ``delay`` > 0; the task info
        becomes ``task`` unless that is None; ``attempts`` - 1 unless ``counted``."""

    @abc.abstractmethod
    def _kill(self, lease: Lease, reason: str, settle_within: float | None,
              error: str | None) -> bool:
        """Fenced: dead with ``reason`` and ``result`` ``error`` (JSON text; None: no result),
        settling as for :meth:`_finish`."""

    @abc.abstractmethod
    def _checkpoint(self, lease: Lease, data: str) -> bool:
        """Fenced: the key's checkpoint becomes ``data``."""

    @abc.abstractmethod
    def _settle_many(self, leases: Sequence[Lease]) -> list[bool]:
        """For each lease (at least one), in order: did it end its key's settle phase?"""

    @abc.abstractmethod
    def _claim_settlement(self, key: str, owner: str, ttl: float) -> Row | None:
        """The rule of :meth:`claim_settlement`; the row as for :meth:`_claim`, or None."""

    @abc.abstractmethod
    def _cancel(self, key: str, reason: str) -> bool:
        """The rule of :meth:`cancel`; ``reason`` is the stored text (``cancelled: …``)."""

    @abc.abstractmethod
    def _force_release(self, key: str, reason: str) -> bool:
        """A running row becomes ready, whoever holds it."""

    @abc.abstractmethod
    def _requeue(self, key: str, reason: str) -> bool:
        """A dead row becomes ready (attempts, takeovers reset); False if it was not dead."""

    @abc.abstractmethod
    def _purge(self, key: str) -> bool:
        """The rule of :meth:`purge`: the row goes unless a live lease holds it."""

    @abc.abstractmethod
    def _purge_older_than(self, seconds: float, limit: int | None) -> int:
        """The rule of :meth:`purge_older_than`; how many rows went."""

    @abc.abstractmethod
    def _get(self, key: str) -> Row | None:
        """The key's row (the columns of the ``get`` query), or None."""

    @abc.abstractmethod
    def _find(self, state: LeaseState | None, prefix: str | None, owner: str | None,
              limit: int) -> list[Row]:
        """Rows matching every filter that is not None, most recently updated first."""

    @abc.abstractmethod
    def _stats(self) -> list[Row]:
        """A row per state present: ``state``, ``total`` rows, ``expired`` (running rows
        whose lease has run out)."""

    @abc.abstractmethod
    def _sweep_expired(self, limit: int, grace: float, nonce: str) -> list[str]:
        """Mark (with ``nonce``) at most ``limit`` rows due for a re-publish, as
        :meth:`sweep_expired` says; their keys."""

    @abc.abstractmethod
    def _sweep_unmark(self, key: str, token: int) -> bool:
        """Clear the sweep's mark on generation ``token`` of ``key``."""

    @abc.abstractmethod
    def _record_history_many(self, entries: list[HistoryEntry]) -> None:
        """Append the entries (at least one), in one write."""

    @abc.abstractmethod
    def _history(self, key: str, limit: int) -> list[HistoryEntry]:
        """The last ``limit`` events of ``key``, oldest first."""

    @abc.abstractmethod
    def _history_many(self, keys: list[str], limit: int) -> dict[str, list[HistoryEntry]]:
        """The last ``limit`` events of each of ``keys`` (at least one), oldest first, in one
        read; keys without events may be left out."""

    @abc.abstractmethod
    def _recent_history(self, events: list[str] | None, limit: int) -> list[HistoryEntry]:
        """The latest ``limit`` events across keys (only ``events`` if not None), newest
        first."""

    @abc.abstractmethod
    def _prune_history(self, cutoff: float, limit: int) -> int:
        """Delete up to ``limit`` entries recorded before ``cutoff``; how many went."""

    @abc.abstractmethod
    def _effect_insert(self, key: str, fingerprint: str, lease: Lease | None) -> bool | None:
        """Insert-if-absent an ``in_flight`` receipt started by ``lease``: True if inserted,
        False if ``key`` has one, None (nothing written) if ``lease`` is not current."""

    @abc.abstractmethod
    def _effect_restart(self, key: str, version: int, lease: Lease | None) -> bool | None:
        """A new attempt if the receipt is at ``version``: True, False, or None (nothing
        written) if ``lease`` is not current."""

    @abc.abstractmethod
    def _effect_get(self, key: str) -> Row | None:
        """The receipt's row (the columns of the ``effect_get`` query), or None."""

    @abc.abstractmethod
    def _effect_find(self, state: EffectState | None, limit: int) -> list[Row]:
        """Receipt rows (only in ``state`` if not None), most recently changed first."""

    @abc.abstractmethod
    def _effect_update(self, key: str, version: int, state: EffectState,
                       result: str | None) -> bool:
        """If at ``version``: the new ``state`` and ``result``, version + 1."""

    @abc.abstractmethod
    def _effect_delete(self, key: str, version: int) -> bool:
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


def group_verdict(*, limit: int | None, interval: float | None, running: int, ahead: int,
                  tat: float | None, now: float) -> str:
    """The rule of a limited claim, once: ``limit`` (over the limit), ``rate`` (before the
    next allowed start ``tat``) or ``granted``.

    ``running``: the group's running rows with unexpired leases (the claimed key's own not
    among them); ``ahead``: its waiters that come before this delivery (all of them for a
    key that is not a waiter). A waiter is never overtaken: a newcomer waits while waiters
    are ahead, and of the waiters, only the first ``limit - running`` may run. The SQLite
    store applies this function; PostgreSQL and Redis apply the same rule in the store's own
    code (one function, one script), on the server.
    """
    if limit is not None and running + ahead >= limit:
        return "limit"
    if interval and tat is not None and tat > now:
        return "rate"
    return "granted"


def effective_limit(task_limit: Any, set_limit: Any) -> int | None:
    """The limit in force: an operator's (0: lifted), else the task's (None: no limit)."""
    if set_limit is not None and set_limit != "":
        return int(set_limit) or None
    return None if task_limit is None or task_limit == "" else int(task_limit)


def effective_interval(task_interval: Any, set_interval: Any) -> float | None:
    """Seconds between two starts in force: an operator's (0: lifted), else the task's."""
    if set_interval is not None and set_interval != "":
        return float(set_interval) or None
    return None if task_interval is None or task_interval == "" else float(task_interval)


def _limit_group_of(row: Row) -> LimitGroup:
    set_limit, set_rate = row.get("set_limit"), row.get("set_rate")
    task_rate = row.get("task_rate") or None
    limit_set = set_limit is not None and set_limit != ""
    rate_set = set_rate is not None
    task_limit = row.get("task_limit")
    return LimitGroup(
        group=str(row["grp"]), limit=effective_limit(task_limit, set_limit),
        rate=(set_rate or None) if rate_set else task_rate,
        running=int(row.get("running") or 0), waiting=int(row.get("waiting") or 0),
        task_limit=None if task_limit in (None, "") else int(task_limit),
        task_rate=task_rate, limit_set=limit_set, rate_set=rate_set,
        updated_at=None if row.get("updated_at") in (None, "") else float(row["updated_at"]))


def check_lease(lease: object) -> Lease:
    """A ``Lease``, or ``TypeError`` naming what was given instead."""
    if not isinstance(lease, Lease):
        raise TypeError(f"expected a Lease, got {type(lease).__name__}: {lease!r}")
    return lease


def _effect_started(started: bool | None, lease: Lease | None) -> bool:
    if started is None:
        assert lease is not None, "a receipt write without a lease cannot be fenced out"
        raise lease_not_current(lease, "when the effect was to start")
    return started


def fence_params(lease: Lease) -> dict[str, Any]:
    """The fencing predicate's parameters: the lease must still be this owner's, this token."""
    return {"key": lease.key, "owner": lease.owner, "token": lease.token}


def lease_not_current(lease: Lease, when: str, *, what: str = "written") -> LeaseLost:
    """The refusal of a write fenced on ``lease`` (``what``: nothing was written/committed)."""
    return LeaseLost(f"lease {lease.key!r} (owner {lease.owner}, token {lease.token}) is not "
                     f"current {when}; nothing was {what}")


def lease_params(lease: Lease | None) -> dict[str, Any]:
    """The columns that record which lease started an effect (all None without a lease)."""
    if lease is None:
        return {"lease_key": None, "lease_token": None, "lease_owner": None}
    return {"lease_key": lease.key, "lease_token": lease.token, "lease_owner": lease.owner}


def settle_deadline_offset(settle_within: float | None) -> float | None:
    """``settle_within`` checked (None: settle at once)."""
    return None if settle_within is None else check_ttl(settle_within, name="settle_within")
