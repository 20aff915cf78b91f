"""Receipts for outside actions: at most one performance per business key, honestly recorded.

A lease decides whose *result* is accepted; it cannot un-send an email. An outside action gets
a stable business key chosen by the caller (``publish:report:42:v1``, never the lease token,
which changes on every takeover) and a fingerprint of its payload. The receipt is written
``in_flight`` before the action runs (outside any transaction) and ``done`` with its result
after. A replay of a ``done`` key returns the recorded result without acting again. A replay
that finds an ``in_flight`` receipt whose lease is no longer current cannot know whether the
action happened: unless the action is declared safe to repeat with the same key
(``retry_same_key=True``, for targets that honour an idempotency key), the receipt becomes
``needs_reconciliation`` and ``EffectOutcomeUnknown`` is raised: never a blind resend.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import shlex
import time
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from celery.exceptions import SoftTimeLimitExceeded

from . import signals
from .checks import check_key, check_ttl, encode_result
from .errors import (
    EffectConflict,
    EffectOutcomeUnknown,
    LeaseError,
    LeaseHeld,
    PayloadNotSerializable,
    ResultNotSerializable,
)
from .models import EffectState, Lease, LeaseRecord, LeaseState, Receipt


class ReceiptStore(Protocol):
    """What ``Effects`` builds on: a store's receipt primitives, its lease rows and its clock
    (``lease_celery.stores.base.Store``'s own methods, which say what each does atomically).
    Typed here rather than by importing the store contract, which builds its ``Effects``:
    the contract depends on this module, never the other way round."""

    def effect_insert(self, key: str, fingerprint: str, lease: Lease | None) -> bool: ...

    def effect_restart(self, key: str, *, version: int, lease: Lease | None) -> bool: ...

    def effect_get(self, key: str) -> Receipt | None: ...

    def effect_find(self, *, state: EffectState | None = None,
                    limit: int = 100) -> list[Receipt]: ...

    def effect_update(self, key: str, *, version: int, state: EffectState,
                      result: str | None) -> bool: ...

    def effect_delete(self, key: str, *, version: int) -> bool: ...

    def get(self, key: str) -> LeaseRecord | None: ...

    def now(self) -> float: ...

__all__ = ["Effects", "ReceiptStore", "fingerprint"]

logger = logging.getLogger(__name__)
_T = TypeVar("_T")

#: Exceptions after which an action may or may not have happened.
_UNKNOWN_OUTCOME: tuple[type[BaseException], ...] = (
    EffectOutcomeUnknown, SoftTimeLimitExceeded, KeyboardInterrupt, SystemExit)

#: How long an ``in_flight`` receipt started without a lease counts as in progress.
DEFAULT_IN_FLIGHT_TIMEOUT = 300.0


def fingerprint(payload: Any) -> str:
    """SHA-256 of the payload's canonical JSON (sorted keys, no spaces, UTF-8)."""
    try:
        canonical = json.dumps(payload, sort_keys=True, separators=(",", ":"),
                               ensure_ascii=False, allow_nan=False).encode("utf-8")
    except (TypeError, ValueError) as exc:  # UnicodeEncodeError (lone surrogates) included
        raise PayloadNotSerializable(
            f"effect payloads must be JSON-serializable; {type(payload).__name__} is not ({exc})"
        ) from exc
    return hashlib.sha256(canonical).hexdigest()


class Effects:
    """Receipts kept in one lease store: ``store.effects``."""

    def __init__(self, store: ReceiptStore) -> None:
        self.store = store

    def once(self, key: str, payload: Any, fn: Callable[[str], _T], *,
             lease: Lease | None = None, retry_same_key: bool = False, wait: float = 0.0,
             in_flight_timeout: float = DEFAULT_IN_FLIGHT_TIMEOUT) -> _T | Any:
        """Run ``fn(key)`` at most once for ``key``; a replay returns the recorded result.

        ``lease``: the lease this attempt runs under (recorded on the receipt, so a later
        attempt can tell a live attempt from an abandoned one). ``retry_same_key``: after an
        abandoned attempt, call ``fn`` again with the same key (the target must deduplicate on
        it) instead of asking for reconciliation. ``wait``: seconds to wait for a live attempt
        by someone else to finish (then return its result) before raising ``LeaseHeld``.

        Raises ``EffectConflict`` (the key was used with another payload; ``fn`` not called),
        ``EffectOutcomeUnknown`` (an earlier attempt's outcome is unknown; resolve or discard
        the receipt), ``LeaseHeld`` (a live attempt is under way). If ``fn`` raises, the receipt
        is removed so that a later attempt can act (raise ``EffectOutcomeUnknown`` from ``fn``
        instead when the action may have happened anyway; a time limit or shutdown that
        interrupts ``fn`` is treated the same way).
        """
        key = check_key(key)
        digest = fingerprint(payload)
        check_ttl(in_flight_timeout, name="in_flight_timeout")
        give_up_at, pause = time.monotonic() + wait, 0.01
        while True:
            if self.store.effect_insert(key, digest, lease):
                return self._perform(key, fn, version=1, digest=digest)
            receipt = self.store.effect_get(key)
            if receipt is None:
                continue  # discarded (or its attempt failed) between our two calls
            if receipt.fingerprint != digest:
                signals.effect_conflict.send(sender=self.store, key=key)
                raise EffectConflict(f"effect {key!r} was recorded with another payload "
                                     f"(fingerprint {receipt.fingerprint[:12]}…, this one "
                                     f"{digest[:12]}…); not performed")
            if receipt.state is EffectState.DONE:
                logger.info("effect %s: replay, returning the recorded result", key)
                signals.effect_replayed.send(sender=self.store, key=key)
                return receipt.result
            if receipt.state is EffectState.NEEDS_RECONCILIATION:
                raise self._unknown(receipt)
            if lease is not None and (receipt.lease_key, receipt.lease_token,
                                      receipt.lease_owner) == (lease.key, lease.token,
                                                               lease.owner):
                # An in-flight receipt of this very lease that this call did not see created:
                # the driver re-sent our insert after losing its reply, and the first send won.
                # (One execution must not run once() for one key from two threads at once.)
                return self._perform(key, fn, version=receipt.version, digest=digest)
            if self._attempt_alive(receipt, in_flight_timeout):
                left = give_up_at - time.monotonic()
                if left > 0:
                    pause = min(pause * 2, 0.5)
                    time.sleep(min(left, random.uniform(pause / 2, pause)))
                    continue
                raise LeaseHeld(f"effect {key!r} is being performed by {receipt.lease_owner} "
                                f"(lease {receipt.lease_key!r} token {receipt.lease_token})")
            # The attempt's lease is gone: it may or may not have acted.
            if retry_same_key:
                if self.store.effect_restart(key, version=receipt.version, lease=lease):
                    logger.warning("effect %s: earlier attempt abandoned; resending with the "
                                   "same key (retry_same_key)", key)
                    return self._perform(key, fn, version=receipt.version + 1, digest=digest)
            elif self.store.effect_update(key, version=receipt.version,
                                          state=EffectState.NEEDS_RECONCILIATION, result=None):
                raise self._unknown(receipt)
            # Lost a race with another replay: look again.

    def _perform(self, key: str, fn: Callable[[str], _T], *, version: int, digest: str) -> _T:
        """Run ``fn`` (outside any transaction) for the in-flight receipt at ``version``."""
        try:
            result = fn(key)
        except _UNKNOWN_OUTCOME:
            # Raised by fn itself, or arriving asynchronously (time limit, shutdown) at any
            # point, perhaps after the action went out: nobody can say it did not happen.
            self.store.effect_update(key, version=version,
                                     state=EffectState.NEEDS_RECONCILIATION, result=None)
            signals.effect_outcome_unknown.send(sender=self.store, key=key)
            raise
        except Exception:
            self.store.effect_delete(key, version=version)  # it did not happen: free the key
            raise
        try:
            encoded: str | None = encode_result(result)
            problem: ResultNotSerializable | None = None
        except ResultNotSerializable as exc:
            encoded, problem = None, exc  # it happened all the same: record that much
        signals.effect_performed.send(sender=self.store, key=key, attempt=version)
        if not self.store.effect_update(key, version=version, state=EffectState.DONE,
                                        result=encoded):
            self._record_known_outcome(key, encoded, digest)
        if problem is not None:
            raise problem
        return result

    def _record_known_outcome(self, key: str, encoded: str | None,
                              fingerprint_of_known: str) -> None:
        """The action happened, but the receipt changed while it ran (a takeover marked it
        ``needs_reconciliation``): what was unknown is known now, so record it."""
        receipt = self.store.effect_get(key)
        if receipt is None:
            # Discarded while it ran: but it did happen, so the receipt must say so, or the
            # next attempt would act again.
            if (self.store.effect_insert(key, fingerprint_of_known, None)
                    and self.store.effect_update(key, version=1, state=EffectState.DONE,
                                                 result=encoded)):
                logger.warning("effect %s: performed after its receipt was discarded; the "
                               "outcome is recorded again", key)
                return
        elif (receipt.state is EffectState.NEEDS_RECONCILIATION
                and self.store.effect_update(key, version=receipt.version,
                                             state=EffectState.DONE, result=encoded)):
            logger.warning("effect %s: performed by an attempt whose lease had lapsed; its "
                           "outcome is recorded, reconciliation is no longer needed", key)
            return
        logger.warning("effect %s: performed, but the receipt changed meanwhile (resolved or "
                       "resent with the same key); the recorded outcome was kept", key)

    def _attempt_alive(self, receipt: Receipt, in_flight_timeout: float) -> bool:
        """Is the attempt that wrote this in-flight receipt still running under its lease?

        A lease that is no longer current never becomes current again (tokens only grow), so
        a "no" here stays true however long we take to act on it.
        """
        now = self.store.now()
        if receipt.lease_key is None:
            return now - receipt.started_at < in_flight_timeout
        record = self.store.get(receipt.lease_key)
        return (record is not None and record.state is LeaseState.RUNNING
                and record.held_by(receipt.lease_owner, receipt.lease_token)
                and record.expires_at is not None and record.expires_at > now)

    def _unknown(self, receipt: Receipt) -> EffectOutcomeUnknown:
        signals.effect_outcome_unknown.send(sender=self.store, key=receipt.key)
        return EffectOutcomeUnknown(
            f"effect {receipt.key!r} needs reconciliation: an attempt by {receipt.lease_owner} "
            f"(lease {receipt.lease_key!r} token {receipt.lease_token}) started and never "
            f"recorded its outcome. Check the target, then: celery -A APP leases effects "
            f"resolve {shlex.quote(receipt.key)} --result JSON if it happened, or celery -A APP "
            f"leases effects discard {shlex.quote(receipt.key)} if it did not (in Python: "
            "store.effects.resolve(key, result) / store.effects.discard(key))")

    # -- what a person uses to reconcile ----------------------------------------------------

    def get(self, key: str) -> Receipt | None:
        return self.store.effect_get(key)

    def find(self, state: EffectState | None = None, limit: int = 100) -> list[Receipt]:
        """Receipts, most recently changed first: ``find(EffectState.NEEDS_RECONCILIATION)``
        is the queue of actions a person must reconcile."""
        return self.store.effect_find(state=state, limit=limit)

    def resolve(self, key: str, result: Any = None, *,
                in_flight_timeout: float = DEFAULT_IN_FLIGHT_TIMEOUT) -> Receipt:
        """Record that the action happened, with ``result``: replays will return it.

        Refused with ``LeaseHeld``, as :meth:`discard` is, while an attempt is still running
        under a current lease: that attempt will record the outcome itself.
        """
        encoded = encode_result(result)
        while True:
            receipt = self._existing(key)
            self._refuse_while_running(receipt, in_flight_timeout, "resolved")
            if self.store.effect_update(key, version=receipt.version, state=EffectState.DONE,
                                        result=encoded):
                return self._existing(key)

    def discard(self, key: str, *,
                in_flight_timeout: float = DEFAULT_IN_FLIGHT_TIMEOUT) -> bool:
        """Forget the receipt (the action did not happen): the next ``once`` performs it.

        Refused with ``LeaseHeld`` while an attempt is still running under a current lease:
        that attempt may yet perform the action.
        """
        while True:
            receipt = self.store.effect_get(key)
            if receipt is None:
                return False
            self._refuse_while_running(receipt, in_flight_timeout, "discarded")
            if self.store.effect_delete(key, version=receipt.version):
                return True

    def _refuse_while_running(self, receipt: Receipt, in_flight_timeout: float,
                              what: str) -> None:
        """An operator's verdict waits for a running attempt: ``LeaseHeld`` until it ends."""
        if (receipt.state is EffectState.IN_FLIGHT
                and self._attempt_alive(receipt, in_flight_timeout)):
            raise LeaseHeld(f"effect {receipt.key!r} is being performed by "
                            f"{receipt.lease_owner} (lease {receipt.lease_key!r} token "
                            f"{receipt.lease_token}); it cannot be {what} while it runs")

    def _existing(self, key: str) -> Receipt:
        receipt = self.store.effect_get(key)
        if receipt is None:
            raise LeaseError(f"no effect receipt for {key!r}")
        return receipt
