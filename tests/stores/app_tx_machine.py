"""The writes in the app's own transaction (issue 39), checked by the reference model: the
model's app database (``Model.app_*``) and a real SQL store with a real app connection to its
database, driven by the same operations (a Hypothesis ``RuleBasedStateMachine``).

A worker's completion is ``begin``, ``Store.lock_in``, the body's app rows, ``finish_in``,
``commit`` (``lease_celery.execution.transactional``), each a rule of its own with the clock
free to move in between (a lease may expire while its transaction is open); a refused lock or
finish rolls the transaction back, as ``AppTransaction`` does. An enqueue in the caller's
transaction is ``record_published_in`` then ``commit`` or ``rollback``. Between them the
store's own calls (claims, renewals, finishes, releases, operator actions, the sweeper) keep
running, with owner names reused (ABA).

One app transaction is open at a time, and the machine never makes a call that would wait
for it (a state machine waiting on itself deadlocks): on SQLite the app transaction holds the
file's write lock (``BEGIN IMMEDIATE``), so while it is open no store write runs at all; on
PostgreSQL it holds the row locks of the keys it locked or wrote, so only store writes to
other keys run (and no sweep, which writes any row). Reads run: they wait for no lock.

After every step: the store's rows are the model's (committed only: what the transaction
wrote is not seen until it commits), the committed app rows are the model's, and, on the real
database, every committed app row's token is its key's accepted finish (the key is done with
that token) and no key has rows of two completions (a key with app rows is never purged: a
done key stays done);
a rolled-back enqueue left no row. Purges, token continuity and faults are the other
machine's (``model_machine``); PostgreSQL runs here without its reply-losing proxy.

``tests/stores/test_model.py`` runs the short profile; ``python -m tests.stores.app_tx_machine``
the long one (docs/proof.md has the figures).
"""

from __future__ import annotations

import argparse
import collections
import os
import time
import uuid
from collections.abc import Callable
from typing import Any

from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from lease_celery import Lease, Store, open_store
from lease_celery.app_connections import AppConnection, app_connection
from lease_celery.models import LeaseState
from lease_celery.stores.model import AppTx, Model
from lease_celery.testing import ManualClock
from tests.stores.model_machine import (
    KEYS,
    OWNERS,
    START,
    STEPS,
    TTLS,
    Target,
    answer_of,
    lease_view,
    record_view,
    target,
    task_info,
)
from tests.support import app_db

PROFILES = {
    "short": dict(max_examples=25, stateful_step_count=25, derandomize=True),
    "long": dict(max_examples=300, stateful_step_count=50),
}

STATS: collections.Counter[str] = collections.Counter()


def make_machine(tgt: Target) -> type[RuleBasedStateMachine]:
    """A state machine class bound to ``tgt`` (each example opens a fresh store on it)."""

    class AppTransactionsAgainstModel(RuleBasedStateMachine):
        leases = Bundle("leases")

        def __init__(self) -> None:
            super().__init__()
            STATS["examples"] += 1
            tgt.clean()
            self.clock = ManualClock(START)
            self.model = Model(self.clock)
            self.store: Store = open_store(tgt.url, clock=self.clock)
            self.raw = app_db.connect(self.store, "driver")
            self.app: AppConnection = app_connection(self.raw)
            # The committed app rows, read on a connection of their own (autocommit).
            self.reader = app_db.connect(self.store, "driver")
            if app_db.dialect(self.store) == "postgres":
                self.reader.autocommit = True
            else:
                self.reader.isolation_level = None
            self.tx: AppTx | None = None  # the model's open app transaction
            self.locked: set[str] = set()  # the keys it holds (PostgreSQL row locks)

        def teardown(self) -> None:
            if self.tx is not None:
                self.app.rollback()
            self.raw.close()
            self.reader.close()
            self.store.close()

        # -- what may run while an app transaction is open --------------------------------

        def writable(self, key: str | None = None) -> bool:
            """May a store write (to ``key``; None: to any row) run now without waiting for
            the open app transaction?"""
            if self.tx is None:
                return True
            if tgt.kind == "sqlite":
                return False  # the app transaction holds the file's write lock
            return key is not None and key not in self.locked

        def compare(self, model_call: Callable[[], Any], store_call: Callable[[], Any],
                    view: Callable[[Any], Any] = lambda answer: answer) -> Any:
            """One call on both: the answers (a value, or ``LeaseLost`` raised) agree."""
            model, real = answer_of(model_call), answer_of(store_call)
            assert (real[0], view(real[1])) == (model[0], view(model[1])), \
                f"store answered {real}, model {model}"
            return real

        def both(self, name: str, *args: Any, **kwargs: Any) -> Any:
            return self.compare(lambda: getattr(self.model, name)(*args, **kwargs),
                                lambda: getattr(self.store, name)(*args, **kwargs))[1]

        def lease_answer(self, name: str, *args: Any, **kwargs: Any) -> Lease | None:
            real = self.compare(
                lambda: getattr(self.model, name)(*args, **kwargs),
                lambda: getattr(self.store, name)(*args, **kwargs),
                lambda answer: lease_view(answer) if isinstance(answer, Lease) else answer)[1]
            return real if isinstance(real, Lease) else None

        # -- the store's own calls ----------------------------------------------------------

        @precondition(lambda self: self.writable() or tgt.kind == "postgres")
        @rule(target=leases, key=st.sampled_from(KEYS), owner=st.sampled_from(OWNERS),
              ttl=TTLS, with_task=st.booleans())
        def claim(self, key: str, owner: str, ttl: float, with_task: bool) -> Any:
            if not self.writable(key):
                return None
            task = task_info("t") if with_task else None
            return self.lease_answer("claim", key, owner=owner, ttl=ttl, task=task)

        @precondition(lambda self: self.writable() or tgt.kind == "postgres")
        @rule(target=leases, lease=leases, ttl=TTLS)
        def renew(self, lease: Lease | None, ttl: float) -> Any:
            if lease is None or not self.writable(lease.key):
                return None
            return self.lease_answer("renew", lease, ttl=ttl)

        @precondition(lambda self: self.writable() or tgt.kind == "postgres")
        @rule(lease=leases, settle=st.sampled_from([None, 2.0]), action=st.sampled_from(
            ["finish", "release", "kill", "settle"]))
        def end(self, lease: Lease | None, settle: float | None, action: str) -> None:
            """A lease ended outside any app transaction (the finish in line, a retry, a
            death), or its settle phase completed."""
            if lease is None or not self.writable(lease.key):
                return
            if action == "finish":
                self.both("finish", lease, "inline", settle_within=settle)
            elif action == "release":
                self.both("release", lease, reason="back")
            elif action == "kill":
                self.both("kill", lease, reason="boom", settle_within=settle)
            else:
                self.both("settle", lease)

        @precondition(lambda self: self.writable() or tgt.kind == "postgres")
        @rule(key=st.sampled_from(KEYS), countdown=st.sampled_from([0.0, 5.0]))
        def record_published(self, key: str, countdown: float) -> None:
            if self.writable(key):
                task = {"options": {"task_id": f"p-{uuid.uuid4().hex[:6]}"}}
                self.both("record_published", key, task=task, countdown=countdown)

        @precondition(lambda self: self.writable() or tgt.kind == "postgres")
        @rule(key=st.sampled_from(KEYS), action=st.sampled_from(
            ["cancel", "force_release", "requeue", "purge"]))
        def operator(self, key: str, action: str) -> None:
            """An operator's action. A purge only of a key no completion committed app rows
            for (a purged key's next life may commit its own: one per key no longer holds);
            an outbox row may then be written on the purged key's tombstone."""
            if action == "purge" and any(name == key for name, _ in self.model.app_rows):
                return
            kwargs = {} if action == "purge" else {"reason": "operator"}
            if self.writable(key):
                self.compare(lambda: getattr(self.model, action)(key, **kwargs),
                             lambda: getattr(self.store, action)(key, **kwargs),
                             lambda answer: answer if isinstance(answer, (bool, type))
                             else answer is not None)

        @precondition(lambda self: self.writable())
        @rule()
        def sweep(self) -> None:
            self.compare(lambda: self.model.sweep_expired(grace=0.0),
                         lambda: self.store.sweep_expired(grace=0.0),
                         lambda answer: answer if isinstance(answer, (set, type))
                         else {record.key for record in answer})

        # -- the clock ------------------------------------------------------------------------

        @rule(seconds=STEPS)
        def advance(self, seconds: float) -> None:
            self.clock.advance(seconds)

        @rule(lease=leases)
        def to_deadline(self, lease: Lease | None) -> None:
            """The clock at a lease's deadline exactly: expired (``expires_at <= now``)."""
            if lease is not None and lease.expires_at > self.clock():
                self.clock.set(lease.expires_at)

        # -- the app's transaction ----------------------------------------------------------

        def running(self) -> list[Lease]:
            """The model's running leases, by key (their deadline may have passed)."""
            return [Lease(key, row.owner, row.token, row.expires_at)
                    for key, row in sorted(self.model.rows.items())
                    if row.state is LeaseState.RUNNING and row.owner is not None
                    and row.expires_at is not None]

        @precondition(lambda self: self.tx is None)
        @rule(target=leases, drawn=st.one_of(st.none(), leases),
              how=st.sampled_from(["claim", "claim", "running", "stale", "drawn", "enqueue"]),
              key=st.sampled_from(KEYS), owner=st.sampled_from(OWNERS), ttl=TTLS)
        def app_begin(self, drawn: Lease | None, how: str, key: str, owner: str,
                      ttl: float) -> Any:
            """A transaction on the app's connection. An enqueue's (the caller's, for
            ``apply_async(lease_transaction=)``), or a completion's start: ``lock_in``
            (refused: ``LeaseLost``, rolled back, nothing held) with a lease just claimed (a
            delivery that starts its body), a running row's (its deadline maybe passed), the
            previous lease of the owner that holds the key again (ABA), or any lease drawn."""
            if how == "enqueue":
                self.app.begin()
                self.tx = AppTx()
                STATS["enqueue transactions"] += 1
                return None
            lease = drawn
            if how == "claim":
                lease = self.lease_answer("claim", key, owner=owner, ttl=ttl,
                                          task=task_info("t"))
            elif how == "running" and (live := self.running()):
                lease = next((one for one in live if one.key == key), live[0])
            elif how == "stale":
                # ABA: the owner's lease, released (a retry) and claimed again by the same
                # owner; its first lease, not expired, must not lock in.
                lease = self.lease_answer("claim", key, owner=owner, ttl=ttl)
                if lease is not None:
                    self.both("release", lease, reason="retry")
                    self.lease_answer("claim", key, owner=owner, ttl=ttl)
            if lease is None or lease.token < 1:
                return None
            self.lock_in(lease)
            return lease

        def lock_in(self, lease: Lease) -> bool:
            """Begin, and lock ``lease`` in: refused, rolled back at once."""
            self.app.begin()
            self.tx = tx = AppTx()
            answer = self.compare(lambda: self.model.lock_in(tx, lease),
                                  lambda: self.store.lock_in(self.app, lease, when="test"))
            if answer[0] == "raised":
                STATS["lock refused"] += 1
                self.rollback()
                return False
            STATS["locked in"] += 1
            self.locked.add(lease.key)
            return True

        @precondition(lambda self: self.tx is None)
        @rule(target=leases, key=st.sampled_from(KEYS), owner=st.sampled_from(OWNERS),
              ttl=TTLS, claim=st.booleans(), writes=st.integers(0, 2), stall=st.booleans(),
              settle=st.sampled_from([None, 2.0]))
        def app_completion(self, key: str, owner: str, ttl: float, claim: bool, writes: int,
                           stall: bool, settle: float | None) -> Any:
            """A whole completion in one step, as ``AppTransaction`` makes it: lock_in, the
            body's rows, (the body outliving its lease), finish_in, commit; refused, rolled
            back. With a lease just claimed, or a running row's."""
            live = self.running()
            lease = (self.lease_answer("claim", key, owner=owner, ttl=ttl, task=task_info("t"))
                     if claim or not live
                     else next((one for one in live if one.key == key), live[0]))
            if lease is None or not self.lock_in(lease):
                return lease
            for _ in range(writes):
                self.app_write()
            if stall:
                self.app_stall()
            self.app_finish(settle, writes)
            if self.tx is not None:
                self.app_commit()
            return lease

        @precondition(lambda self: self.tx is None)
        @rule(keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=2),
              countdown=st.sampled_from([0.0, 5.0]), commit=st.booleans())
        def app_enqueue(self, keys: list[str], countdown: float, commit: bool) -> None:
            """A whole enqueue in the caller's transaction, in one step: the rows, then the
            commit (each row exists, the outbox the sweeper publishes from) or a rollback
            (none does)."""
            self.app.begin()
            self.tx = AppTx()
            STATS["enqueue transactions"] += 1
            for key in keys:
                self.app_record_published(key, countdown)
            if commit:
                self.app_commit()
            else:
                self.rollback()

        @precondition(lambda self: self.tx is not None and self.tx.lease is not None
                      and not self.tx.finished)
        @rule()
        def app_stall(self) -> None:
            """The body outlives its lease: the clock at its deadline (expired), the
            transaction still open (the row lock keeps every claim of the key waiting)."""
            assert self.tx is not None and self.tx.lease is not None
            self.clock.set(max(self.clock(), self.tx.lease.expires_at))

        @precondition(lambda self: self.tx is not None and self.tx.lease is not None
                      and not self.tx.finished)
        @rule()
        def app_write(self) -> None:
            """A row of the body's own (it may write several): the job is the key, its number
            the lease's token."""
            assert self.tx is not None and self.tx.lease is not None
            lease = self.tx.lease
            self.model.app_write(self.tx, lease.key, lease.token)
            app_db.insert(self.raw, self.store, lease.key, lease.token)

        @precondition(lambda self: self.tx is not None and self.tx.lease is not None
                      and not self.tx.finished)
        @rule(settle=st.sampled_from([None, 2.0]), result=st.integers(0, 3))
        def app_finish(self, settle: float | None, result: int) -> None:
            """The finish in the transaction, judged now (the clock may have passed the
            deadline since the lock): refused, the whole transaction rolls back."""
            tx = self.tx
            assert tx is not None and tx.lease is not None
            lease = tx.lease
            answer = self.compare(
                lambda: self.model.finish_in(tx, lease, {"r": result}, settle_within=settle),
                lambda: self.store.finish_in(self.app, lease, {"r": result},
                                             settle_within=settle))
            if answer != ("ok", True):
                STATS["finish refused in tx"] += 1
                self.rollback()

        @precondition(lambda self: self.tx is not None)
        @rule(key=st.sampled_from(KEYS), countdown=st.sampled_from([0.0, 5.0]))
        def app_record_published(self, key: str, countdown: float) -> None:
            """An enqueue in the open transaction: the row is the message's outbox."""
            tx = self.tx
            assert tx is not None
            task = {"options": {"task_id": f"o-{uuid.uuid4().hex[:6]}"}}
            self.compare(
                lambda: self.model.record_published_in(tx, key, task=task, countdown=countdown),
                lambda: self.store.record_published_in(self.app, key, task=task,
                                                       countdown=countdown))
            self.locked.add(key)

        @precondition(lambda self: self.tx is not None
                      and (self.tx.lease is None or self.tx.finished))
        @rule()
        def app_commit(self) -> None:
            """The commit: a completion only after its accepted finish (as AppTransaction
            does), an enqueue transaction whenever."""
            assert self.tx is not None
            self.app.commit()
            self.model.app_commit(self.tx)
            STATS["committed"] += 1
            self.tx, self.locked = None, set()

        @precondition(lambda self: self.tx is not None)
        @rule()
        def app_rollback(self) -> None:
            self.rollback()

        def rollback(self) -> None:
            """Rolled back: none of its rows, lease rows or app rows, is seen, ever."""
            assert self.tx is not None
            touched = [key for key in self.tx.pending if key not in self.model.rows]
            self.app.rollback()
            self.model.app_rollback(self.tx)
            STATS["rolled back"] += 1
            self.tx, self.locked = None, set()
            for key in touched:  # an enqueue rolled back left no outbox row
                assert self.store.get(key) is None, f"{key}: a rolled-back row is seen"

        # -- every row, after every step ----------------------------------------------------

        @invariant()
        def rows_agree(self) -> None:
            STATS["checks"] += 1
            found = {record.key: record for record in self.store.find(limit=100)}
            assert set(found) == set(self.model.rows), (sorted(found), sorted(self.model.rows))
            for key in KEYS:
                real, model = found.get(key), self.model.rows.get(key)
                assert record_view(real) == record_view(model), \
                    f"row {key}: store {record_view(real)} != model {record_view(model)}"
            app_rows = sorted(self.reader.execute(
                f"SELECT job, n FROM {app_db.table(self.store)}").fetchall())
            assert app_rows == sorted(self.model.app_rows), (app_rows, self.model.app_rows)
            # The promise itself, read off the real database alone: each committed app row
            # belongs to its key's accepted finish, and a key has the rows of one completion
            # at most (one token: a body may write several rows, one execution commits).
            tokens = collections.defaultdict(set)
            for key, token in app_rows:
                tokens[key].add(token)
            assert all(len(seen) == 1 for seen in tokens.values()), \
                f"two completions committed their rows: {app_rows}"
            for key, token in app_rows:
                record = found.get(key)
                assert record is not None and record.state is LeaseState.DONE \
                    and record.token == token, f"app row {key}/{token} but the row is {record}"

    AppTransactionsAgainstModel.TestCase.settings = settings(deadline=None)
    return AppTransactionsAgainstModel


def run(kind: str, profile: str, **overrides: Any) -> collections.Counter[str]:
    """Run the machine against a fresh SQL store of ``kind``; what it did (``STATS``)."""
    STATS.clear()
    if profile == "short" and kind == "postgres":
        # Every step is a few round trips to a server other runs share: fewer examples keep
        # the store tier's budget. The mutation check (benchmarks.model_mutations) was run
        # at this number.
        overrides = {"max_examples": 15, **overrides}
    with target(kind, proxied=False) as tgt:
        machine = make_machine(tgt)
        phases = list(Phase) if os.environ.get("LEASE_MODEL_SHRINK", "1") != "0" else [
            phase for phase in Phase if phase is not Phase.shrink]
        run_state_machine_as_test(machine, settings=settings(
            **{**PROFILES[profile], **overrides}, deadline=None, database=None, phases=phases,
            suppress_health_check=list(HealthCheck)))
    return collections.Counter(STATS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--stores", default="sqlite,postgres")
    parser.add_argument("--profile", default="long", choices=sorted(PROFILES))
    parser.add_argument("--examples", type=int)
    args = parser.parse_args()
    overrides = {} if args.examples is None else {"max_examples": args.examples}
    for kind in args.stores.split(","):
        started = time.monotonic()
        stats = run(kind, args.profile, **overrides)
        print(f"{kind}: {args.profile} profile passed in {time.monotonic() - started:.1f} s: "
              f"{stats['examples']} examples, {stats['checks']} steps checked, "
              f"{stats['locked in']} locked in, {stats['committed']} committed, "
              f"{stats['rolled back']} rolled back, {stats['finish refused in tx']} finishes "
              "refused in a transaction", flush=True)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    main()
