"""The store contract as a small executable model: rows in a dict, a clock, each rule once.

Sequential and in memory; nothing here talks to a database. It is the specification the real
stores are held to: ``tests/stores/test_model.py`` drives it and every store with the same
calls and compares every answer and every row, and ``benchmarks/chaos`` judges the histories
of a real run against it. It lives in the package (beside the contract it restates, importing
only the basic types) because both of those import it, and tests and benchmarks may depend on
the package but not on each other. Nothing in the package imports it.

One module past the house's ~400 lines on purpose: the contract is read in one place.

The app's own database (issue 39) is part of the state too: app rows (each with the token of
the lease whose transaction wrote it) and one open app transaction at a time, whose pending
rows, finish and recorded publishes are seen by that transaction only and commit together or
not at all (:class:`AppTx`, ``Model.app_*``).

What it leaves out, on purpose: history entries and the store-wide fence (their numbers have
gaps by design), the operator reads' ordering, and the Redis state indexes (a cache of what
is here). Times are the store's clock, the ``now`` each call is given.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

from ..errors import LeaseLost, StoreDataLost
from ..models import EffectState, Lease, LeaseState

__all__ = ["AppTx", "Effect", "Group", "Model", "ModelRow"]

READY, RUNNING, DONE, DEAD = (LeaseState.READY, LeaseState.RUNNING, LeaseState.DONE,
                              LeaseState.DEAD)


@dataclasses.dataclass
class ModelRow:
    """A lease row: what ``Store.get`` shows, plus when the sweeper looks at it next."""

    state: LeaseState
    owner: str | None = None
    token: int = 0
    expires_at: float | None = None
    attempts: int = 0
    takeovers: int = 0
    not_before: float | None = None
    reason: str | None = None
    task: dict[str, Any] | None = None
    settling: bool = False
    checkpoint: Any = None
    cancel: str | None = None
    result: Any = None
    updated_at: float = 0.0
    group: str | None = None
    slot: int | None = None
    # The sweeper's next look (None: never): only rows with task info that are not settled.
    sweep_at: float | None = None

    def current(self, lease: Lease, now: float) -> bool:
        """The fencing rule, once: running, this owner, this token, ``expires_at > now``."""
        return (self.state is RUNNING and self.owner == lease.owner
                and self.token == lease.token and self.expires_at is not None
                and self.expires_at > now)

    def claimable(self, now: float) -> bool:
        """Ready past its backoff, or running with a lease that ran out (``<=``: the boundary
        instant is expired)."""
        if self.state is READY:
            return self.not_before is None or self.not_before <= now
        return self.state is RUNNING and self.expires_at is not None and self.expires_at <= now


@dataclasses.dataclass
class Effect:
    """An effect receipt."""

    fingerprint: str
    state: EffectState
    lease: tuple[str, int, str] | None
    started_at: float
    attempts: int
    result: str | None
    version: int
    updated_at: float


@dataclasses.dataclass
class Group:
    """A limit group: the task's limit and rate, an operator's, the rate's next start (tat)."""

    task_limit: int | None = None
    task_interval: float | None = None
    set_limit: int | None = None  # 0: lifted
    set_interval: float | None = None  # 0: lifted
    tat: float | None = None
    slots: int = 0
    seq: int = 0
    # key -> [seq, task, since, handed_at]
    waiters: dict[str, list[Any]] = dataclasses.field(default_factory=dict)

    def limit(self) -> int | None:
        if self.set_limit is not None:
            return self.set_limit or None
        return self.task_limit

    def interval(self) -> float | None:
        if self.set_interval is not None:
            return self.set_interval or None
        return self.task_interval


@dataclasses.dataclass
class AppTx:
    """An open transaction on the app's connection: the lease it locked in (None: a caller's
    transaction that only enqueues), the app rows written in it (key, token), and the lease
    rows it wrote (finish_in, record_published_in) as that transaction sees them (None: no
    row); the store's rows change only when it commits."""

    lease: Lease | None = None
    app_rows: list[tuple[str, int]] = dataclasses.field(default_factory=list)
    pending: dict[str, ModelRow | None] = dataclasses.field(default_factory=dict)
    finished: bool = False  # a finish_in was accepted in it


def _task_id_only(task: dict[str, Any] | None) -> dict[str, Any] | None:
    """A settled done row keeps only its task id and its delivery's context (if any)."""
    if task is None:
        return None
    kept: dict[str, Any] = {"options": {"task_id": (task.get("options") or {}).get("task_id")}}
    if task.get("context") is not None:
        kept["context"] = task["context"]
    return kept


class Model:
    """The store contract, sequential. ``clock`` is the store's clock; ``keeps_epoch``: the
    store keeps an epoch (Redis): tokens start above its floor, and a data loss is refused
    with ``StoreDataLost`` until :meth:`reset_epoch`."""

    def __init__(self, clock: Callable[[], float], *, keeps_epoch: bool = False) -> None:
        self.clock = clock
        self.keeps_epoch = keeps_epoch
        self.rows: dict[str, ModelRow] = {}
        # The last token each key was given: kept when its row is purged (tokens never restart).
        self.tokens: dict[str, int] = {}
        self.effects: dict[str, Effect] = {}
        self.groups: dict[str, Group] = {}
        # The epoch (Redis): every token is above its floor (0 for the SQL stores). The
        # record exists once a store object's first call wrote it; ``seen``: the store object
        # making the calls opened it; ``lost``: a store object that had seen it found it gone
        # and marked it lost, and every write refuses until an operator's reset.
        self.floor = 0
        self.epoch_exists = self.seen = self.lost = False
        # The app's database: committed app rows (key, token of the writing lease), in order.
        self.app_rows: list[tuple[str, int]] = []

    # -- the epoch -------------------------------------------------------------------------

    def _now(self) -> float:
        """The clock for a call, on the store's epoch (which the first call opens)."""
        now = self.clock()
        if not self.keeps_epoch:
            return now
        if not self.lost and self.seen and not self.epoch_exists:
            self.lost = True  # the record this store object opened is gone: data was lost
        if self.lost:
            raise StoreDataLost("the store lost acknowledged writes")
        if not self.epoch_exists:  # an empty store opens a new epoch without a step
            self.epoch_exists, self.floor = True, math.floor(now * 1_000_000)
        self.seen = True
        return now

    def open_for_read(self) -> None:
        """An operator read by a store object that has not opened the epoch opens it (the
        Redis store's reads find the epoch record so); one that has, checks nothing."""
        if self.keeps_epoch and not self.seen:
            if self.lost:
                raise StoreDataLost("the store lost acknowledged writes")
            if not self.epoch_exists:
                self.epoch_exists, self.floor = True, math.floor(self.clock() * 1_000_000)
            self.seen = True

    def restart(self) -> None:
        """A new store object (a restarted process): it has seen no epoch yet."""
        self.seen = False

    def lose_data(self) -> None:
        """The server came back empty (Redis restarted without persistence)."""
        self.rows.clear()
        self.tokens.clear()
        self.effects.clear()
        self.groups.clear()
        self.epoch_exists = self.lost = False

    def reset_epoch(self) -> None:
        """An operator accepts the loss. The new floor is the clock in microseconds (above
        the record's floor if the record survived): tokens continue above every number
        handed out, as long as the clock moved on by more microseconds than claims were
        made (the Redis store's assumption, stated in ``RedisStore``)."""
        floor = math.floor(self.clock() * 1_000_000)
        self.floor = max(floor, self.floor + 1) if self.epoch_exists else floor
        self.epoch_exists = self.seen = True
        self.lost = False

    # -- the lease's life ------------------------------------------------------------------

    def _take(self, key: str, owner: str, ttl: float, task: dict[str, Any] | None,
              now: float, group: str | None = None, slot: int | None = None) -> Lease | None:
        row = self.rows.get(key)
        if row is not None and not row.claimable(now):
            return None
        takeover = row is not None and row.state is RUNNING
        token = max(self.tokens.get(key, 0), self.floor) + 1
        self.tokens[key] = token
        expires_at = now + ttl
        new = ModelRow(
            state=RUNNING, owner=owner, token=token, expires_at=expires_at,
            attempts=(row.attempts if row else 0) + 1,
            takeovers=(row.takeovers if row else 0) + int(takeover),
            reason=row.reason if row else None, task=task,
            checkpoint=row.checkpoint if row else None, cancel=row.cancel if row else None,
            updated_at=now, group=group, slot=slot,
            sweep_at=None if task is None else expires_at)
        self.rows[key] = new
        return Lease(key, owner, token, expires_at, attempts=new.attempts,
                     takeovers=new.takeovers, cancel=new.cancel, group=group, slot=slot)

    def claim(self, key: str, *, owner: str, ttl: float,
              task: dict[str, Any] | None = None) -> Lease | None:
        return self._take(key, owner, ttl, task, self._now())

    def record_published(self, key: str, *, task: dict[str, Any], countdown: float = 0.0
                         ) -> bool:
        now = self._now()
        if key in self.rows:
            return False
        self.rows[key] = ModelRow(state=READY, token=self.tokens.get(key, 0), task=task,
                                  updated_at=now, sweep_at=now + countdown)
        return True

    def renew(self, lease: Lease, *, ttl: float) -> Lease | None:
        """Running and current, or settling with this owner and token and before its
        deadline (the owner extends its settle phase)."""
        now = self._now()
        row = self.rows.get(lease.key)
        if row is None or not (row.state is RUNNING or row.settling):
            return None
        if (row.owner, row.token) != (lease.owner, lease.token):
            return None
        if row.expires_at is None or row.expires_at <= now:
            return None
        row.expires_at, row.updated_at = now + ttl, now
        row.sweep_at = None if row.task is None else row.expires_at
        return dataclasses.replace(lease, expires_at=row.expires_at, cancel=row.cancel)

    def _end(self, lease: Lease, state: LeaseState, now: float,
             settle_within: float | None) -> ModelRow | None:
        """The fenced ending of a lease (finish, kill): the row, or None if not current."""
        row = self.rows.get(lease.key)
        if row is None or not row.current(lease, now):
            return None
        row.state, row.updated_at = state, now
        row.settling = settle_within is not None
        row.expires_at = now + (settle_within or 0.0)
        row.sweep_at = row.expires_at if row.settling and row.task is not None else None
        return row

    def finish(self, lease: Lease, result: Any = None, *,
               settle_within: float | None = None) -> bool:
        now = self._now()
        row = self._end(lease, DONE, now, settle_within)
        if row is None:
            return False
        row.result, row.reason, row.checkpoint, row.cancel = result, None, None, None
        if not row.settling:
            row.task = _task_id_only(row.task)
        return True

    def finish_and_claim(self, finished: Lease, result: Any, key: str, *, owner: str,
                         ttl: float, task: dict[str, Any] | None = None
                         ) -> tuple[bool, Lease | None]:
        """The carried finish: :meth:`finish` of ``finished`` (settled at once) and
        :meth:`claim` of ``key`` in one step, each judged by its own rule (on the same key,
        the finish first)."""
        accepted = self.finish(finished, result)
        return accepted, self.claim(key, owner=owner, ttl=ttl, task=task)

    def kill(self, lease: Lease, *, reason: str, settle_within: float | None = None,
             error: Any = None) -> bool:
        """Dead with ``reason``; its result is ``error`` (the failure it died of), or none."""
        row = self._end(lease, DEAD, self._now(), settle_within)
        if row is not None:
            row.reason, row.result = reason, error
        return row is not None

    def release(self, lease: Lease, *, delay: float = 0.0, reason: str | None = None,
                task: dict[str, Any] | None = None, counted: bool = True) -> bool:
        now = self._now()
        row = self.rows.get(lease.key)
        if row is None or not row.current(lease, now):
            return False
        row.state, row.expires_at, row.updated_at, row.reason = READY, now, now, reason
        row.not_before = now + delay if delay > 0 else None
        row.task = task if task is not None else row.task
        row.attempts -= 0 if counted else 1
        row.sweep_at = None if row.task is None else (row.not_before or now)
        return True

    def checkpoint(self, lease: Lease, data: Any) -> bool:
        now = self._now()
        row = self.rows.get(lease.key)
        if row is None or not row.current(lease, now):
            return False
        row.checkpoint = data
        return True

    def settle(self, lease: Lease) -> bool:
        """Ends the settle phase of this owner and token. Asked again by the lease that
        settled it, the answer is still True (a re-sent confirmation is told the truth)."""
        self._now()
        row = self.rows.get(lease.key)
        if row is None or (row.owner, row.token) != (lease.owner, lease.token):
            return False
        if row.settling:
            row.settling, row.sweep_at, row.updated_at = False, None, self.clock()
            if row.state is DONE:
                row.task = _task_id_only(row.task)
            return True
        return row.state in (DONE, DEAD)

    def claim_settlement(self, key: str, *, owner: str, ttl: float) -> Lease | None:
        now = self._now()
        row = self.rows.get(key)
        if row is None or not row.settling or row.expires_at is None or row.expires_at > now:
            return None
        row.owner, row.expires_at, row.updated_at = owner, now + ttl, now
        row.sweep_at = None if row.task is None else row.expires_at
        return Lease(key, owner, row.token, row.expires_at, attempts=row.attempts,
                     takeovers=row.takeovers)

    # -- operator actions ------------------------------------------------------------------

    def cancel(self, key: str, *, reason: str) -> bool:
        """A live holder is asked (its next renewal says so); a key nobody holds goes dead
        at once, keeping its token; done and dead keys are left alone."""
        now = self._now()
        reason = f"cancelled: {reason.strip() or 'by an operator'}"[:2000]
        row = self.rows.get(key)
        if (row is not None and row.state is RUNNING and row.expires_at is not None
                and row.expires_at > now):
            row.cancel = reason
            return True
        if row is not None and row.state in (DONE, DEAD):
            return False
        if row is None:
            row = self.rows[key] = ModelRow(state=DEAD, token=self.tokens.get(key, 0))
        row.state, row.reason, row.cancel, row.expires_at = DEAD, reason, reason, now
        row.updated_at, row.not_before, row.settling, row.sweep_at = now, None, False, None
        return True

    def force_release(self, key: str, *, reason: str) -> bool:
        now = self._now()
        row = self.rows.get(key)
        if row is None or row.state is not RUNNING:
            return False
        row.state, row.expires_at, row.updated_at, row.not_before = READY, now, now, None
        row.reason, row.sweep_at = reason, None if row.task is None else now
        return True

    def requeue(self, key: str, *, reason: str) -> bool:
        now = self._now()
        row = self.rows.get(key)
        if row is None or row.state is not DEAD:
            return False
        row.state, row.attempts, row.takeovers, row.not_before = READY, 0, 0, None
        row.updated_at, row.reason, row.settling, row.cancel = now, reason, False, None
        row.sweep_at = None if row.task is None else now
        return True

    def purge(self, key: str) -> bool:
        """The row goes unless a live lease holds it; its token is kept apart."""
        now = self._now()
        row = self.rows.get(key)
        if row is None or (row.state is RUNNING and row.expires_at is not None
                           and row.expires_at > now):
            return False
        del self.rows[key]
        return True

    def purge_older_than(self, seconds: float) -> int:
        """Settled done/dead rows not updated for ``seconds`` go (their tokens kept)."""
        now = self._now()
        old = [key for key, row in self.rows.items()
               if row.state in (DONE, DEAD) and not row.settling
               and row.updated_at < now - seconds]
        for key in old:
            del self.rows[key]
        return len(old)

    def sweep_expired(self, *, grace: float) -> set[str]:
        """The rows nobody will run unless re-published, each marked for a grace period: a
        lease or settle phase past its deadline, a ready row unclaimed ``grace`` after it
        became claimable. Only rows with task info."""
        now = self._now()
        marked = set()
        for key, row in self.rows.items():
            if row.sweep_at is None or row.sweep_at > now or row.task is None:
                continue
            live = row.state is RUNNING or row.settling
            if live and row.expires_at is not None and row.expires_at <= now:
                row.sweep_at = now + grace
            elif row.state is READY and row.sweep_at <= now - grace:
                row.sweep_at = now
            else:
                continue
            marked.add(key)
        return marked

    # -- effect receipts -------------------------------------------------------------------

    def _fenced_out(self, lease: Lease | None, now: float) -> bool:
        row = None if lease is None else self.rows.get(lease.key)
        return lease is not None and (row is None or not row.current(lease, now))

    def effect_insert(self, key: str, fingerprint: str, lease: Lease | None) -> bool:
        now = self._now()
        if self._fenced_out(lease, now):
            raise LeaseLost(f"lease of {key!r} is not current")
        if key in self.effects:
            return False
        self.effects[key] = Effect(
            fingerprint, EffectState.IN_FLIGHT,
            None if lease is None else (lease.key, lease.token, lease.owner), now, 1, None, 1,
            now)
        return True

    def effect_restart(self, key: str, *, version: int, lease: Lease | None) -> bool:
        now = self._now()
        if self._fenced_out(lease, now):
            raise LeaseLost(f"lease of {key!r} is not current")
        effect = self.effects.get(key)
        if effect is None or effect.version != version:
            return False
        effect.state, effect.started_at, effect.updated_at = EffectState.IN_FLIGHT, now, now
        effect.lease = None if lease is None else (lease.key, lease.token, lease.owner)
        effect.attempts, effect.version = effect.attempts + 1, effect.version + 1
        return True

    def effect_update(self, key: str, *, version: int, state: EffectState,
                      result: str | None) -> bool:
        now = self._now()
        effect = self.effects.get(key)
        if effect is None or effect.version != version:
            return False
        effect.state, effect.result, effect.updated_at = state, result, now
        effect.version += 1
        return True

    def effect_delete(self, key: str, *, version: int) -> bool:
        self._now()
        effect = self.effects.get(key)
        if effect is None or effect.version != version:
            return False
        del self.effects[key]
        return True

    # -- key-group limits ------------------------------------------------------------------

    def claim_limited(self, key: str, *, owner: str, ttl: float, group: str,
                      limit: int | None, interval: float | None,
                      task: dict[str, Any] | None = None) -> Lease | str | None:
        """A claim and a slot of ``group`` at once: the lease, ``"limit"`` (parked as the
        group's waiter when it has task info), ``"rate"``, or None (the key refuses)."""
        now = self._now()
        g = self.groups.setdefault(group, Group())
        g.task_limit, g.task_interval = limit, interval
        row = self.rows.get(key)
        if row is not None and not row.claimable(now):
            g.waiters.pop(key, None)
            return None
        running = sum(1 for k, r in self.rows.items()
                      if k != key and r.group == group and r.state is RUNNING
                      and r.expires_at is not None and r.expires_at > now)
        mine = g.waiters.get(key)
        ahead = sum(1 for w in g.waiters.values() if mine is None or w[0] < mine[0])
        lim, every = g.limit(), g.interval()
        if lim is not None and running + ahead >= lim:
            if task is not None and mine is None:
                g.seq += 1
                g.waiters[key] = [g.seq, task, now, None]
            elif task is not None and mine is not None:
                mine[3] = None  # handed on and refused again: it keeps its place
            return "limit"
        if every and g.tat is not None and g.tat > now:
            return "rate"
        lease = self._take(key, owner, ttl, task, now, group, g.slots + 1)
        assert lease is not None, "claimable was checked above"
        g.slots += 1
        if every:
            g.tat = max(g.tat if g.tat is not None else now, now) + every
        g.waiters.pop(key, None)
        return lease

    def hand_on(self, group: str, *, grace: float) -> list[str]:
        """The first waiters of ``group`` a slot is free for, not handed on within ``grace``;
        marked handed."""
        now = self._now()
        g = self.groups.get(group)
        if g is None or not g.waiters:
            return []
        free = len(g.waiters)
        if (lim := g.limit()) is not None:
            free = min(free, lim - sum(1 for r in self.rows.values()
                                       if r.group == group and r.state is RUNNING
                                       and r.expires_at is not None and r.expires_at > now))
        handed = []
        for key, waiter in sorted(g.waiters.items(), key=lambda item: item[1][0])[:max(free, 0)]:
            if waiter[3] is None or waiter[3] <= now - grace:
                waiter[3] = now
                handed.append(key)
        return handed

    def set_limit(self, group: str, *, concurrency: int | None = None,
                  interval: float | None = None, reset: bool = False) -> None:
        """An operator's concurrency limit (0: lifted) and interval (0: lifted); ``reset``:
        the tasks' own again. A changed rate starts afresh (no next start carried over)."""
        self._now()
        g = self.groups.setdefault(group, Group())
        if reset:
            g.set_limit, g.set_interval, g.tat = None, None, None
        if concurrency is not None:
            g.set_limit = concurrency
        if interval is not None:
            g.set_interval, g.tat = interval, None

    # -- the app's own transaction (Store.lock_in, finish_in, record_published_in) ---------

    def _within(self, tx: AppTx, key: str, call: Callable[[], Any]) -> Any:
        """``call`` as ``tx`` sees the rows (the committed ones, under its own pending
        writes); what it writes to ``key`` stays pending in ``tx``."""
        view = dict(self.rows)
        for name, pending in tx.pending.items():
            if pending is None:
                view.pop(name, None)
            else:
                view[name] = pending
        if key not in tx.pending and key in view:
            view[key] = dataclasses.replace(view[key])
        saved, self.rows = self.rows, view
        try:
            return call()
        finally:
            self.rows = saved
            tx.pending[key] = view.get(key)

    def lock_in(self, tx: AppTx, lease: Lease) -> None:
        """The fencing rule in the app's transaction: ``LeaseLost`` unless ``lease`` is
        current; then its row is the transaction's until it ends (no claim can commit)."""
        now = self._now()

        def check() -> None:
            row = self.rows.get(lease.key)
            if row is None or not row.current(lease, now):
                raise LeaseLost(f"lease of {lease.key!r} is not current")

        self._within(tx, lease.key, check)
        tx.lease = lease

    def app_write(self, tx: AppTx, key: str, token: int) -> None:
        """The body's own row, in the app's transaction."""
        tx.app_rows.append((key, token))

    def finish_in(self, tx: AppTx, lease: Lease, result: Any = None, *,
                  settle_within: float | None = None) -> bool:
        """:meth:`finish`, judged now, written in ``tx``: it commits with ``tx``."""
        accepted: bool = self._within(
            tx, lease.key, lambda: self.finish(lease, result, settle_within=settle_within))
        tx.finished = tx.finished or accepted
        return accepted

    def record_published_in(self, tx: AppTx, key: str, *, task: dict[str, Any],
                            countdown: float = 0.0) -> bool:
        """:meth:`record_published` in ``tx``: the row exists once ``tx`` commits."""
        answer: bool = self._within(
            tx, key, lambda: self.record_published(key, task=task, countdown=countdown))
        return answer

    def app_commit(self, tx: AppTx) -> None:
        """Everything ``tx`` wrote, at once: its lease rows and its app rows."""
        for key, row in tx.pending.items():
            if row is None:
                self.rows.pop(key, None)
            else:
                self.rows[key] = row
        self.app_rows.extend(tx.app_rows)

    def app_rollback(self, tx: AppTx) -> None:
        """Nothing ``tx`` wrote is kept (the model's rows were never touched)."""
        tx.pending.clear()
        tx.app_rows.clear()
