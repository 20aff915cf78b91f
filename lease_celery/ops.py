"""Operator actions, written once: what ``celery leases``, the web dashboard and any other
operator interface do to a store.

Each action is a method of :class:`Operations` (procrastinate's ``JobManager`` is the model:
one object shared by every interface). It acts through the store's one conditional write, and
records one entry in a history: event ``operator:<action>`` (one of :data:`ACTIONS`), detail
``<actor>: <what was done>``, where the actor is the interface's word for who acted
(``ann@host via the CLI``, ``web 127.0.0.1``). An interface says what happened in its own way
(exit codes and lines, pages), but what is done and what the history records are decided
here, so the same action leaves the same entry whichever interface took it.

A refusal (no such key, or a state the action does not apply to) raises :class:`Refusal`
and changes and records nothing. An action that was done but could not be recorded says so
(``Done.unrecorded``) instead of raising: the change stands, and hiding it would be worse.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Any

from .checks import encode_result
from .errors import ConfigError, LeaseError, LeaseHeld
from .execution.answers import ANSWER_MARK
from .execution.delivery import republish
from .execution.limited import publish_waiters
from .keys import DIRECT_KEY_PREFIX
from .limits import LimitGroup, Waiter
from .models import EffectState, EpochReset, LeaseRecord, LeaseState
from .stores.base import Store

__all__ = ["ACTIONS", "LIMIT_KEY_PREFIX", "STORE_KEY", "Done", "Operations", "Refusal",
           "event_of", "internal_row", "state_of"]

logger = logging.getLogger(__name__)

#: Every operator action; each is recorded as ``operator:<action>``.
ACTIONS = ("release", "cancel", "requeue", "purge", "limit", "reset-epoch", "resolve",
           "discard")
#: Where an action on the whole store (purge, reset-epoch) is recorded: a key in
#: lease_celery's own namespace, as a group's limit is under ``LIMIT_KEY_PREFIX + group``.
STORE_KEY = "lease_celery:store"
LIMIT_KEY_PREFIX = "lease_celery:limit:"
#: What a requeue that publishes nothing itself leaves to the workers.
SWEEPER_PUBLISHES = "a worker's sweeper re-publishes its task after lease_sweep_grace"


def event_of(action: str) -> str:
    """The history event an action is recorded as."""
    if action not in ACTIONS:
        raise ValueError(f"{action!r} is not an operator action ({', '.join(ACTIONS)})")
    return f"operator:{action}"


def internal_row(key: str) -> str | None:
    """What a row lease_celery keeps for itself is, or None for a user's key.

    Such rows are leases like any other (fenced, settled, swept, pruned by lease_retention),
    but they are not work a user named: the answer to a duplicate delivered under another
    task id (``KEY#answer:ID``, ``execution.answers``) and a direct call of a task that has
    no lease_key (``direct:UUID``, ``keys.DIRECT_KEY_PREFIX``). Listings leave them out
    unless asked, and name them when shown."""
    if ANSWER_MARK in key:
        return ("answer to a duplicate delivered under another task id (its own result and "
                "callbacks)")
    if key.startswith(DIRECT_KEY_PREFIX):
        return "direct call of a task without lease_key (an errback, task(...))"
    return None


class Refusal(LeaseError):
    """The action does not apply (no such key, or not in a state that allows it): nothing
    was changed or recorded. ``missing``: there is nothing of that name at all."""

    def __init__(self, message: str, *, missing: bool = False) -> None:
        super().__init__(message)
        self.missing = missing


@dataclass(frozen=True)
class Done:
    """What an action did, and the history entry that records it.

    ``key``: whose history holds the entry (a receipt's lease key, ``STORE_KEY``, ...);
    ``detail``: the entry's detail after the actor; ``unrecorded``: why the entry could not
    be written (None when it was). The other fields are the action's own results."""

    action: str
    key: str
    detail: str
    token: int | None = None
    unrecorded: str | None = None
    record: LeaseRecord | None = None
    #: requeue: the task id published, or why nothing was (``publish_error``).
    task_id: str | None = None
    publish_error: str | None = None
    #: purge: how many rows; limit: the group now and the waiters published.
    count: int = 0
    group: LimitGroup | None = None
    handed_on: list[Waiter] = field(default_factory=list)
    #: reset-epoch: the new epoch and what it replaced.
    epoch: EpochReset | None = None
    #: resolve and discard: the effect receipt's key; resolve: the result recorded.
    effect_key: str | None = None
    result: Any = None
    #: requeue: what became of its task (published, or who publishes it).
    outcome: str | None = None

    @property
    def event(self) -> str:
        return event_of(self.action)


def state_of(record: LeaseRecord) -> str:
    """The record's state as an operator needs it: a pending cancel or a settle phase too."""
    if record.state is LeaseState.RUNNING and record.cancel:
        return (f"running, with a cancel pending ({record.cancel}): its holder stops at its "
                "next heartbeat, and the key then ends dead")
    if record.settling:
        return f"{record.state.value} (settling: its owner is confirming the outcome)"
    return record.state.value


class Operations:
    """The operator actions on ``store``, recorded as done by ``actor``.

    ``app``: the Celery app that publishes a requeued key's task and the waiters a raised
    limit lets run (None: nothing is published here, the workers' sweeper does it)."""

    def __init__(self, store: Store, *, actor: str, app: Any = None) -> None:
        self.store, self.actor, self.app = store, actor, app

    # -- leases ----------------------------------------------------------------------------

    def release(self, key: str, *, reason: str) -> Done:
        """A running lease made ready, whoever holds it (its holder's result is refused)."""
        if not self.store.force_release(key, reason=reason):
            record = self.store.get(key)
            raise Refusal(f"lease {key!r} is not running "
                          f"({record.state.value if record else 'none'})",
                          missing=record is None)
        record = self.store.get(key)
        return self._record(Done("release", key, reason, record=record,
                                 token=record.token if record else None))

    def cancel(self, key: str, *, reason: str) -> Done:
        """The key cancelled: a running holder stops at its next heartbeat, a key not yet
        started never runs; it ends dead (``cancelled: REASON``) until requeued."""
        done = self.store.cancel(key, reason=reason)
        record = self.store.get(key)
        if not done or record is None:
            raise Refusal(f"no lease for key {key!r}" if record is None else
                          f"lease {key!r} is {state_of(record)}: nothing to cancel",
                          missing=record is None)
        return self._record(Done("cancel", key, reason, record=record, token=record.token))

    def requeue(self, key: str, *, reason: str, publish: bool = True) -> Done:
        """A dead key made ready with fresh attempts (its token continues), and its recorded
        task published again when ``publish`` and there is an app to publish with; else, or
        when the broker refuses, the sweeper re-publishes it (``Done.publish_error`` says
        why nothing was published here)."""
        record = self.store.requeue(key, reason=reason)
        if record is None:
            current = self.store.get(key)
            raise Refusal(f"no lease for key {key!r}" if current is None else
                          f"lease {key!r} is {state_of(current)}: only a dead lease can be "
                          "requeued", missing=current is None)
        task_id = error = None
        if not publish or self.app is None:
            outcome = f"not published here: {SWEEPER_PUBLISHES}"
        elif record.task is None:
            error = "no task is recorded on it: publish it yourself"
            outcome = f"not published: {error}"
        else:
            try:
                # A fresh start: Celery's retry count begins again, like the lease's attempts.
                task_id = republish(self.app, record.task, retries=0).id
                outcome = f"task {task_id} published"
            except Exception as exc:  # the broker refused: the row stays ready for a sweeper
                error = f"{type(exc).__name__}: {exc}"
                outcome = f"not published ({error}): {SWEEPER_PUBLISHES}"
        return self._record(Done("requeue", key, f"{reason}; {outcome}", token=record.token,
                                 record=record, task_id=task_id, publish_error=error,
                                 outcome=outcome))

    def purge(self, older_than: float) -> Done:
        """Done and dead rows not changed for ``older_than`` seconds deleted; their tokens
        are kept, so keys never restart their count."""
        count = self.store.purge_older_than(older_than)
        return self._record(Done("purge", STORE_KEY, f"purged {count} done/dead lease(s) not "
                                 f"changed for {older_than:g}s", count=count))

    # -- limit groups ----------------------------------------------------------------------

    def limit(self, group: str, *, concurrency: int | bool | None = None,
              rate: str | bool | None = None, reset: bool = False) -> Done:
        """The operator's concurrency limit and rate for ``group`` (each: a value, False to
        lift it, None unchanged; ``reset``: back to the tasks' own), and the waiters the
        change lets run handed on (published at once when there is an app)."""
        try:
            found = self.store.set_limit(group, concurrency=concurrency, rate=rate, reset=reset)
        except ConfigError as exc:
            raise Refusal(str(exc)) from exc
        waiters = self.store.hand_on(group, grace=0.0)
        handed = publish_waiters(self.app, waiters) if self.app is not None else []
        what = ("reset to the tasks' own; " if reset else "") + (
            f"concurrency {'-' if found.limit is None else found.limit}, rate "
            f"{found.rate or '-'}; {len(handed)} waiter(s) published")
        return self._record(Done("limit", LIMIT_KEY_PREFIX + group, what, group=found,
                                 handed_on=handed))

    # -- the store -------------------------------------------------------------------------

    def reset_epoch(self) -> Done:
        """The store's new epoch after its server lost data (see ``Store.reset_epoch``)."""
        try:
            reset = self.store.reset_epoch()
        except ConfigError as exc:  # a store that keeps no epoch
            raise Refusal(str(exc)) from exc
        before = (f"replaced epoch {reset.replaced}" if reset.replaced
                  else "no epoch record was left")
        if reset.lost:
            before += f" (marked lost: {reset.lost})"
        return self._record(Done("reset-epoch", STORE_KEY, f"new epoch {reset.epoch.id}: "
                                 f"tokens continue above {reset.epoch.floor}; {before}",
                                 epoch=reset))

    # -- effect receipts -------------------------------------------------------------------

    def resolve(self, effect_key: str, result: Any) -> Done:
        """A receipt whose outcome was unknown marked done with ``result`` (it happened):
        replays return it. Recorded in its lease's history."""
        receipt = self.store.effects.get(effect_key)
        if receipt is None:
            raise Refusal(f"no effect receipt for {effect_key!r}", missing=True)
        if receipt.state is EffectState.DONE:
            raise Refusal(f"receipt {effect_key!r} is done already; its recorded result was "
                          "kept")
        try:
            self.store.effects.resolve(effect_key, result)
        except LeaseHeld as exc:
            raise Refusal(str(exc)) from exc
        return self._record(Done(
            "resolve", receipt.lease_key or effect_key,
            f"effect {effect_key!r} resolved (it happened), result {encode_result(result)}",
            token=receipt.lease_token, effect_key=effect_key, result=result))

    def discard(self, effect_key: str) -> Done:
        """A receipt removed (the action did not happen): the next attempt performs it."""
        receipt = self.store.effects.get(effect_key)
        if receipt is None:
            raise Refusal(f"no effect receipt for {effect_key!r}", missing=True)
        try:
            gone = self.store.effects.discard(effect_key)
        except LeaseHeld as exc:
            raise Refusal(str(exc)) from exc
        if not gone:
            raise Refusal(f"no effect receipt for {effect_key!r}", missing=True)
        return self._record(Done("discard", receipt.lease_key or effect_key,
                                 f"effect {effect_key!r} discarded (it did not happen)",
                                 token=receipt.lease_token, effect_key=effect_key))

    def _record(self, done: Done) -> Done:
        try:
            self.store.record_history(done.key, done.event, token=done.token,
                                      detail=f"{self.actor}: {done.detail}")
        except LeaseError as exc:
            logger.error("%s on %r done but not recorded in its history: %s", done.event,
                         done.key, exc)
            return replace(done, unrecorded=str(exc))
        return done

