"""The reference model (``lease_celery.stores.model``) and a real store driven by the same
operations, every answer and every row compared after each step (a Hypothesis
``RuleBasedStateMachine``).

The store runs on a ``ManualClock`` it shares with the model (``open_store(url, clock=...)``:
the injected authority clock every store passes to its own statements and scripts in place of
the server's), so leases expire exactly when a rule moves the clock, including to a deadline
itself. Faults: the store object restarted, its connections killed under it, a reply lost
after the write was applied (Redis), and a Redis server that lost its data (the epoch).

``tests/stores/test_model.py`` runs it in the store tier (the short profile);
``python -m tests.stores.model_machine`` runs the long one (docs/proof.md has its figures).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import os
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg
import redis
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from lease_celery import Lease, Store, open_store
from lease_celery.errors import LeaseLost, StoreDataLost, StoreError
from lease_celery.limits import GroupLimit, LimitRefused, parse_rate
from lease_celery.models import EffectState, LeaseRecord, LeaseState
from lease_celery.stores.model import Model, ModelRow
from lease_celery.testing import ManualClock
from tests.support.mysql_databases import TABLES, database, server_connection
from tests.support.proxy import ReplyDroppingProxy
from tests.support.servers import PG_DSN, REDIS_STORE_URL

KEYS = ("k1", "k2", "k3")
# Few owner names, reused: a lease of w1 that expired and a new lease of w1 differ only by
# their token (the ABA case a fence must tell apart).
OWNERS = ("w1", "w2")
EFFECT_KEYS = ("e1", "e2")
GROUP = "g"
START = 1_000.0
TTLS = st.sampled_from([0.5, 1.0, 2.0, 5.0])
# Multiples of 0.5: exact in binary, so the store's '%.6f' text and the model agree exactly.
STEPS = st.sampled_from([0.0, 0.5, 1.0, 2.0, 5.0, 30.0])

#: Writes whose re-send after a lost reply finds its own effect and answers False: the row is
#: as asked, only the answer under-reports. Operator actions (postgres.py's _cancel says so),
#: and the receipts' insert-if-absent and version-conditional writes (Effects.once tells its
#: own in-flight receipt by the lease on it: test_effects.py). Anything else must answer the
#: truth or raise StoreError.
UNDER_REPORTED = frozenset({"cancel", "force_release", "requeue", "purge", "purge_older_than",
                            "effect_insert", "effect_restart", "effect_update",
                            "effect_delete"})

#: A second ending call (finish, kill, release) by a lease that already ended its key, made
#: on a connection that died: the store cannot tell its re-send from the first call that did
#: reach the server, and answers True (``Store.settled_by``: the row has this lease's owner and
#: token). Not a double accept (the row is the first call's); the runtime ends a lease once.
#: Recorded in docs/proof.md's bug table as known.
REPEATED_ENDINGS = ("finish", "kill", "release")

#: Faults are drawn as often as any operation, and act on one draw in four: a store killed at
#: every other step tests its reconnection more than its rules (and killing a PostgreSQL
#: backend costs ~0.1 s).
RARE = st.integers(0, 3)

#: The profiles: "short" in the store tier (derandomized: the same examples on every run, so
#: the mutation table in docs/proof.md can be reproduced), "long" as a command.
PROFILES = {
    "short": dict(max_examples=40, stateful_step_count=30, derandomize=True),
    "long": dict(max_examples=400, stateful_step_count=60),
}


#: What the last run did: examples (a fresh store each), and row checks (one per step).
STATS: collections.Counter[str] = collections.Counter()


@dataclasses.dataclass
class Target:
    """A store under test: how to open it fresh for one example, and its faults."""

    kind: str
    url: str
    clean: Callable[[], None]
    kill: Callable[[], None] | None = None  # kill the store's connections under it
    lose: Callable[[], None] | None = None  # the server loses every key (Redis)
    proxy: ReplyDroppingProxy | None = None  # PostgreSQL through it: a reply can be lost


@contextlib.contextmanager
def target(kind: str, *, proxied: bool = True) -> Iterator[Target]:
    """A fresh, isolated store of ``kind`` (a file, a schema, a key prefix), and its faults
    (``proxied=False``: PostgreSQL without the reply-losing proxy, so without lost replies)."""
    run = uuid.uuid4().hex[:12]
    if kind == "sqlite":
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp, "model.sqlite3")

            def remove() -> None:
                for name in (path, Path(f"{path}-wal"), Path(f"{path}-shm")):
                    name.unlink(missing_ok=True)

            yield Target(kind, f"sqlite:///{path}", remove)
        return
    if kind == "postgres":
        schema, app = f"lease_model_{run}", f"lease-model-{run}"

        admin = psycopg.connect(PG_DSN, autocommit=True)

        def kill() -> None:
            admin.execute("SELECT pg_terminate_backend(pid, 5000) FROM pg_stat_activity "
                          "WHERE application_name = %s", (app,))

        def drop() -> None:
            with psycopg.connect(PG_DSN, autocommit=True) as admin:
                admin.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')

        def empty() -> None:
            # Each example on empty tables: a schema made afresh each time took ~1 s.
            with psycopg.connect(PG_DSN, autocommit=True) as admin:
                tables = [name for (name,) in admin.execute(
                    "SELECT tablename FROM pg_tables WHERE schemaname = %s", (schema,))]
                if tables:
                    admin.execute("TRUNCATE " + ", ".join(f'"{schema}"."{name}"'
                                                         for name in tables))

        pg = urlsplit(PG_DSN)
        server = (pg.hostname or "127.0.0.1", pg.port or 5432)
        proxy = ReplyDroppingProxy(server) if proxied else None
        where = f"127.0.0.1:{proxy.port}" if proxy is not None else f"{server[0]}:{server[1]}"
        url = urlunsplit((pg.scheme, where, pg.path,
                          f"schema={schema}&application_name={app}&sslmode=disable", ""))
        try:
            yield Target(kind, url, empty, kill, proxy=proxy)
        finally:
            if proxy is not None:
                proxy.close()
            admin.close()
            drop()
        return
    if kind == "mysql":
        with mysql_target() as found:
            yield found
        return
    prefix, name = f"lease_model_{run}:", f"lease-model-{run}"
    client = redis.Redis.from_url(REDIS_STORE_URL)

    def lose() -> None:
        # What a restart without persistence leaves of this store's keys: nothing.
        for found in client.scan_iter(f"{prefix}*", count=1000):
            client.delete(found)

    def kill_clients() -> None:
        for info in client.client_list():
            if info.get("name") == name:
                client.client_kill_filter(_id=info["id"])

    try:
        yield Target(kind, f"{REDIS_STORE_URL}?prefix={prefix}&client_name={name}", lose,
                     kill_clients, lose)
    finally:
        lose()
        client.close()


@contextlib.contextmanager
def mysql_target() -> Iterator[Target]:
    """A MySQL store on a database of its own, emptied for each example; its connections
    killed by an administrator's KILL (no lost replies: the proxy speaks PostgreSQL's
    protocol)."""
    with database() as url:
        name = urlsplit(url).path.lstrip("/")
        admin = server_connection()

        def kill() -> None:
            with admin.cursor() as cur:
                cur.execute("SELECT id FROM information_schema.processlist "
                            "WHERE db = %s AND id <> CONNECTION_ID()", (name,))
                for (found,) in cur.fetchall():
                    with contextlib.suppress(Exception):
                        cur.execute(f"KILL CONNECTION {int(found)}")

        def empty() -> None:
            with admin.cursor() as cur:
                for table in TABLES:
                    with contextlib.suppress(Exception):  # no tables before the first store
                        cur.execute(f"DELETE FROM `{name}`.`{table}`")

        try:
            yield Target("mysql", url, empty, kill)
        finally:
            admin.close()


def task_info(prefix: str) -> dict[str, Any]:
    """A delivery's task info as the gate records it: a task id and the delivery's context
    (a settled done row keeps both)."""
    return {"options": {"task_id": f"{prefix}-{uuid.uuid4().hex[:6]}"},
            "context": uuid.uuid4().hex[:16]}


def answer_of(call: Callable[[], Any]) -> tuple[str, Any]:
    """What a call answered: ("ok", value) or ("raised", the exception's class)."""
    try:
        return "ok", call()
    except (LeaseLost, StoreDataLost) as exc:
        return "raised", type(exc)


def lease_view(lease: Lease | None) -> tuple[Any, ...] | None:
    if lease is None:
        return None
    return (lease.key, lease.owner, lease.token, lease.expires_at, lease.attempts,
            lease.takeovers, lease.cancel, lease.group, lease.slot)


def record_view(record: LeaseRecord | ModelRow | None) -> dict[str, Any] | None:
    """The fields of a row the contract fixes (not the fence, history or updated_at of a
    read: see ``lease_celery.stores.model``)."""
    if record is None:
        return None
    names = ("state", "owner", "token", "expires_at", "attempts", "takeovers", "not_before",
             "reason", "task", "settling", "checkpoint", "cancel", "result")
    return {name: getattr(record, name) for name in names}


def make_machine(tgt: Target) -> type[RuleBasedStateMachine]:
    """A state machine class bound to ``tgt`` (each example opens a fresh store on it)."""

    class StoreAgainstModel(RuleBasedStateMachine):
        leases = Bundle("leases")

        def __init__(self) -> None:
            super().__init__()
            STATS["examples"] += 1
            tgt.clean()
            self.clock = ManualClock(START)
            self.model = Model(self.clock, keeps_epoch=tgt.kind == "redis")
            self.store: Store = open_store(tgt.url, clock=self.clock)
            self.lose_next_reply = False
            self.disturbed = False  # connections killed (or a reply lost) before the next call
            self.highest: dict[str, int] = {}  # the highest token each key was ever given

        def teardown(self) -> None:
            self.store.close()

        # -- doing one operation on both --------------------------------------------------

        def compare(self, model_call: Callable[[], Any], store_call: Callable[[], Any],
                    view: Callable[[Any], Any] = lambda answer: answer, *,
                    under_reports: bool = False, repeat: bool = False) -> tuple[Any, Any]:
            """Make one call on the model and on the store: the answers (a value, or
            ``LeaseLost``/``StoreDataLost`` raised) must agree. After a lost reply the store
            may instead raise ``StoreError`` (the caller is told the outcome is unknown); the
            rows must still match the model's, which the invariant checks."""
            model = answer_of(model_call)
            lose, self.lose_next_reply = self.lose_next_reply, False
            disturbed, self.disturbed = self.disturbed or lose, False
            try:
                with self.replies_lost(lose):
                    real = answer_of(store_call)
            except StoreError:
                if not lose:
                    raise
                return model[1], model[1]
            if lose and under_reports and real[0] == "ok" and real[1] in (False, 0):
                return model[1], real[1]  # the re-send found its own effect: see UNDER_REPORTED
            if disturbed and repeat and (real, model) == (("ok", True), ("ok", False)):
                return model[1], real[1]  # a repeated ending: see REPEATED_ENDINGS
            assert (real[0], view(real[1])) == (model[0], view(model[1])), \
                f"store answered {real}, model {model}"
            return model[1], real[1]

        def both(self, name: str, *args: Any, repeat: bool = False, **kwargs: Any) -> Any:
            """``compare`` of the same method with the same arguments; the store's answer."""
            return self.compare(lambda: getattr(self.model, name)(*args, **kwargs),
                                lambda: getattr(self.store, name)(*args, **kwargs),
                                repeat=repeat, under_reports=name in UNDER_REPORTED)[1]

        def ended_by(self, lease: Lease) -> bool:
            """Did ``lease`` itself end its key (the row still has its owner and token)?"""
            row = self.model.rows.get(lease.key)
            return (row is not None and row.state is not LeaseState.RUNNING
                    and (row.owner, row.token) == (lease.owner, lease.token))

        @contextlib.contextmanager
        def replies_lost(self, lose: bool) -> Iterator[None]:
            """The next script (Redis) or statement (PostgreSQL, through the proxy) runs,
            then its reply is lost with the connection."""
            if not lose:
                yield
                return
            if tgt.proxy is not None:
                tgt.proxy.drop_reply_to(b"")  # whatever the store sends next
                try:
                    yield
                finally:
                    tgt.proxy.disarm()
                return
            caller = self.store._caller  # type: ignore[attr-defined]
            real = caller.run

            def losing(*args: Any, **kwargs: Any) -> Any:
                caller.run = real
                real(*args, **kwargs)
                raise redis.ConnectionError("test: the reply was lost")

            caller.run = losing
            try:
                yield
            finally:
                caller.run = real

        def granted(self, name: str, model: Any, real: Any) -> Lease | None:
            """The lease a claim (or renewal) answered; a new token must be above every
            token the key was ever given, across purges and epochs."""
            for lease in (model, real):
                if isinstance(lease, Lease):
                    before = self.highest.get(lease.key, 0)
                    if name not in ("renew", "claim_settlement"):
                        assert lease.token > before, (
                            f"token {lease.token} of {lease.key} is not above {before}: "
                            "a token went back")
            for lease in (model, real):
                if isinstance(lease, Lease):
                    self.highest[lease.key] = max(self.highest.get(lease.key, 0), lease.token)
            return real if isinstance(real, Lease) else None

        def lease_answer(self, name: str, *args: Any, **kwargs: Any) -> Lease | None:
            model, real = self.compare(
                lambda: getattr(self.model, name)(*args, **kwargs),
                lambda: getattr(self.store, name)(*args, **kwargs),
                lambda answer: lease_view(answer) if isinstance(answer, Lease) else answer)
            return self.granted(name, model, real)

        # -- the lease's life -------------------------------------------------------------

        @rule(target=leases, key=st.sampled_from(KEYS), owner=st.sampled_from(OWNERS),
              ttl=TTLS, with_task=st.booleans())
        def claim(self, key: str, owner: str, ttl: float, with_task: bool) -> Any:
            task = task_info("t") if with_task else None
            return self.lease_answer("claim", key, owner=owner, ttl=ttl, task=task)

        @rule(target=leases, key=st.sampled_from(KEYS), owner=st.sampled_from(OWNERS),
              ttl=TTLS, limit=st.sampled_from([1, 2, None]), rate=st.booleans(),
              with_task=st.booleans())
        def claim_limited(self, key: str, owner: str, ttl: float, limit: int | None,
                          rate: bool, with_task: bool) -> Any:
            if limit is None and not rate:
                limit = 1
            parsed = parse_rate("1/s") if rate else None
            task = task_info("t") if with_task else None

            def view(answer: Any) -> Any:
                if isinstance(answer, LimitRefused):
                    return answer.reason
                return lease_view(answer) if isinstance(answer, Lease) else answer

            model, real = self.compare(
                lambda: self.model.claim_limited(
                    key, owner=owner, ttl=ttl, group=GROUP, limit=limit,
                    interval=None if parsed is None else parsed.interval, task=task),
                lambda: self.store.claim_limited(
                    key, owner=owner, ttl=ttl, limit=GroupLimit(GROUP, limit, parsed),
                    task=task),
                view)
            return self.granted("claim", model, real)

        @rule(group_limit=st.sampled_from([None, 0, 1, 2]), rate=st.sampled_from(
            [None, False, "2/s"]), reset=st.booleans())
        def set_limit(self, group_limit: int | None, rate: Any, reset: bool) -> None:
            if group_limit is None and rate is None and not reset:
                reset = True
            interval = None if rate is None else (0.0 if rate is False
                                                  else parse_rate(rate).interval)
            self.compare(
                lambda: self.model.set_limit(GROUP, concurrency=group_limit, interval=interval,
                                             reset=reset),
                lambda: self.store.set_limit(GROUP, concurrency=False if group_limit == 0
                                             else group_limit, rate=rate, reset=reset),
                lambda answer: None)

        @rule(grace=st.sampled_from([0.0, 5.0]))
        def hand_on(self, grace: float) -> None:
            self.compare(lambda: self.model.hand_on(GROUP, grace=grace),
                         lambda: self.store.hand_on(GROUP, grace=grace),
                         lambda answer: answer if isinstance(answer, type) else
                         [w if isinstance(w, str) else w.key for w in answer])

        @rule(target=leases, lease=leases, ttl=TTLS)
        def renew(self, lease: Lease | None, ttl: float) -> Any:
            if lease is None:
                return None
            return self.lease_answer("renew", lease, ttl=ttl)

        @rule(lease=leases, settle=st.sampled_from([None, 2.0]), result=st.integers(0, 3))
        def finish(self, lease: Lease | None, settle: float | None, result: int) -> None:
            if lease is not None:
                self.both("finish", lease, {"r": result}, settle_within=settle,
                          repeat=self.ended_by(lease))

        @rule(target=leases, lease=leases, key=st.sampled_from(KEYS),
              owner=st.sampled_from(OWNERS), ttl=TTLS, result=st.integers(0, 3))
        def finish_and_claim(self, lease: Lease | None, key: str, owner: str, ttl: float,
                             result: int) -> Any:
            """The carried finish (a worker's finish of ``lease`` in its next claim's
            transaction): its answer and its claim's are the model's. A lease that already
            ended its key, on a disturbed connection, may be answered True (REPEATED_ENDINGS)."""
            if lease is None:
                return None
            lenient = self.ended_by(lease) and (self.disturbed or self.lose_next_reply)
            task = task_info("t")

            def view(answer: Any) -> Any:
                if not isinstance(answer, tuple):
                    return answer
                accepted, claimed = answer
                return (accepted or lenient,
                        lease_view(claimed) if isinstance(claimed, Lease) else claimed)

            model, real = self.compare(
                lambda: self.model.finish_and_claim(lease, {"r": result}, key, owner=owner,
                                                    ttl=ttl, task=task),
                lambda: self.store.finish_and_claim(lease, {"r": result}, key, owner=owner,
                                                    ttl=ttl, task=task),
                view)
            return self.granted("finish_and_claim",
                                model[1] if isinstance(model, tuple) else None,
                                real[1] if isinstance(real, tuple) else None)

        @rule(lease=leases, settle=st.sampled_from([None, 2.0]), with_error=st.booleans())
        def kill(self, lease: Lease | None, settle: float | None, with_error: bool) -> None:
            if lease is not None:
                error = {"exc_type": "RuntimeError", "exc_message": ["boom"],
                         "exc_module": "builtins"} if with_error else None
                self.both("kill", lease, reason="boom", settle_within=settle, error=error,
                          repeat=self.ended_by(lease))

        @rule(lease=leases, delay=st.sampled_from([0.0, 2.0]), counted=st.booleans(),
              new_task=st.booleans())
        def release(self, lease: Lease | None, delay: float, counted: bool,
                    new_task: bool) -> None:
            if lease is not None:
                task = {"options": {"task_id": "retry"}} if new_task else None
                self.both("release", lease, delay=delay, reason="back", task=task,
                          counted=counted, repeat=self.ended_by(lease))

        @rule(lease=leases, data=st.integers(0, 3))
        def checkpoint(self, lease: Lease | None, data: int) -> None:
            if lease is not None:  # the store is given JSON text and gives back its value
                self.compare(lambda: self.model.checkpoint(lease, data),
                             lambda: self.store.checkpoint(lease, str(data)))

        @rule(lease=leases)
        def settle(self, lease: Lease | None) -> None:
            if lease is not None:
                self.both("settle", lease)

        @rule(target=leases, key=st.sampled_from(KEYS), owner=st.sampled_from(OWNERS),
              ttl=TTLS)
        def claim_settlement(self, key: str, owner: str, ttl: float) -> Any:
            return self.lease_answer("claim_settlement", key, owner=owner, ttl=ttl)

        @rule(key=st.sampled_from(KEYS), countdown=st.sampled_from([0.0, 5.0]))
        def record_published(self, key: str, countdown: float) -> None:
            # Each publish is a message of its own (Celery gives each a task id): a re-send
            # after a dead connection tells its first send's row by the task info it wrote.
            task = {"options": {"task_id": f"p-{uuid.uuid4().hex[:6]}"}}
            self.both("record_published", key, task=task, countdown=countdown)

        # -- operators, the sweeper, retention --------------------------------------------

        @rule(key=st.sampled_from(KEYS), action=st.sampled_from(
            ["cancel", "force_release", "requeue", "purge"]))
        def operator(self, key: str, action: str) -> None:
            kwargs = {} if action == "purge" else {"reason": "operator"}
            # requeue answers the record (or None), the model whether it requeued
            self.compare(lambda: getattr(self.model, action)(key, **kwargs),
                         lambda: getattr(self.store, action)(key, **kwargs),
                         lambda answer: answer if isinstance(answer, (bool, type))
                         else answer is not None, under_reports=action in UNDER_REPORTED)

        @rule(seconds=st.sampled_from([0.0, 5.0, 60.0]))
        def purge_older_than(self, seconds: float) -> None:
            self.both("purge_older_than", seconds)

        @initialize(grace=st.sampled_from([0.0, 5.0]))
        def sweeper_grace(self, grace: float) -> None:
            """The sweeper's grace is a deployment's setting: one per example (the Redis
            store keeps a row's next look in an index scored with it)."""
            self.grace = grace

        @rule()
        def sweep(self) -> None:
            grace = self.grace
            self.compare(lambda: self.model.sweep_expired(grace=grace),
                         lambda: self.store.sweep_expired(grace=grace),
                         lambda answer: answer if isinstance(answer, (set, type))
                         else {record.key for record in answer})

        # -- effect receipts --------------------------------------------------------------

        @rule(key=st.sampled_from(EFFECT_KEYS), fingerprint=st.sampled_from(["a", "b"]),
              lease=st.one_of(st.none(), leases))
        def effect_insert(self, key: str, fingerprint: str, lease: Lease | None) -> None:
            self.both("effect_insert", key, fingerprint, lease)

        @rule(key=st.sampled_from(EFFECT_KEYS), lease=st.one_of(st.none(), leases),
              stale=st.booleans())
        def effect_restart(self, key: str, lease: Lease | None, stale: bool) -> None:
            effect = self.model.effects.get(key)
            version = (effect.version if effect else 1) - int(stale)
            self.both("effect_restart", key, version=version, lease=lease)

        @rule(key=st.sampled_from(EFFECT_KEYS), state=st.sampled_from(list(EffectState)),
              stale=st.booleans(), delete=st.booleans())
        def effect_update(self, key: str, state: EffectState, stale: bool,
                          delete: bool) -> None:
            effect = self.model.effects.get(key)
            version = (effect.version if effect else 1) - int(stale)
            if delete:
                self.both("effect_delete", key, version=version)
            else:
                self.both("effect_update", key, version=version, state=state, result='"r"')

        # -- the clock --------------------------------------------------------------------

        @rule(seconds=STEPS)
        def advance(self, seconds: float) -> None:
            self.clock.advance(seconds)

        @rule(lease=leases)
        def to_deadline(self, lease: Lease | None) -> None:
            """The clock at a lease's deadline exactly: expired (``expires_at <= now``)."""
            if lease is not None and lease.expires_at > self.clock():
                self.clock.set(lease.expires_at)

        # -- the boundaries, in one step each ---------------------------------------------

        def live(self) -> list[Lease]:
            """The model's live leases (running, deadline not passed), by key."""
            now = self.clock()
            return [Lease(key, row.owner, row.token, row.expires_at)
                    for key, row in sorted(self.model.rows.items())
                    if row.state is LeaseState.RUNNING and row.owner is not None
                    and row.expires_at is not None and row.expires_at >= now]

        @precondition(lambda self: bool(self.live()))
        @rule(which=st.integers(0, 2), owner=st.sampled_from(OWNERS),
              settle=st.sampled_from([None, 2.0]))
        def at_deadline(self, which: int, owner: str, settle: float | None) -> None:
            """The clock stops at the deadline of a live lease exactly (expired:
            ``expires_at <= now``): each fenced write of its holder is tried at that instant
            (the model refuses them all, so they leave the row as it was), then a claim."""
            live = self.live()
            lease = live[which % len(live)]
            key = lease.key
            self.clock.set(lease.expires_at)
            self.lease_answer("renew", lease, ttl=1.0)
            self.compare(lambda: self.model.checkpoint(lease, 1),
                         lambda: self.store.checkpoint(lease, "1"))
            self.both("finish", lease, "late", settle_within=settle)
            self.both("release", lease)
            self.both("kill", lease, reason="late", settle_within=settle)
            self.lease_answer("claim", key, owner=owner, ttl=1.0)

        @rule(key=st.sampled_from(KEYS), owner=st.sampled_from(OWNERS))
        def life_purged_and_again(self, key: str, owner: str) -> None:
            """A key's whole life, purged, and claimed again: its token continues."""
            lease = self.lease_answer("claim", key, owner=owner, ttl=1.0)
            if lease is not None:
                self.both("finish", lease, "ok")
            self.both("purge", key)
            self.lease_answer("claim", key, owner=owner, ttl=1.0)

        # -- faults -----------------------------------------------------------------------

        @rule(draw=RARE)
        def restart(self, draw: int) -> None:
            """The store object (the worker process) restarts: a new one on the same URL."""
            if draw:
                return
            self.store.close()
            self.store = open_store(tgt.url, clock=self.clock)
            self.model.restart()

        @precondition(lambda self: tgt.kill is not None)
        @rule(draw=RARE)
        def kill_connections(self, draw: int) -> None:
            if draw:
                return
            assert tgt.kill is not None
            tgt.kill()
            self.disturbed = True

        @precondition(lambda self: tgt.kind == "redis" or tgt.proxy is not None)
        @rule(draw=RARE)
        def lose_reply(self, draw: int) -> None:
            if draw:
                return
            self.lose_next_reply = True

        @precondition(lambda self: tgt.lose is not None)
        @rule(draw=RARE)
        def lose_data(self, draw: int) -> None:
            """Redis restarted without persistence: every key of the store gone. A restart
            takes time (the epoch's floor is the clock in microseconds)."""
            if draw:
                return
            assert tgt.lose is not None
            self.clock.advance(1.0)
            tgt.lose()
            self.model.lose_data()

        @precondition(lambda self: tgt.kind == "redis")
        @rule(draw=RARE)
        def reset_epoch(self, draw: int) -> None:
            if draw:
                return
            self.store.reset_epoch()
            self.model.reset_epoch()

        # -- every row, after every step --------------------------------------------------

        @invariant()
        def rows_agree(self) -> None:
            STATS["checks"] += 1
            # One read of each table (find, effects.find): every row, as an operator sees it.
            model_lost = answer_of(self.model.open_for_read)[0] == "raised"
            try:
                found = {record.key: record for record in self.store.find(limit=100)}
            except StoreDataLost:
                assert model_lost, "the store says it lost its data, the model does not"
                return
            assert not model_lost, "the model lost its data, the store's read did not say so"
            assert set(found) == set(self.model.rows), (sorted(found), sorted(self.model.rows))
            for key in KEYS:
                real, model = found.get(key), self.model.rows.get(key)
                assert record_view(real) == record_view(model), \
                    f"row {key}: store {record_view(real)} != model {record_view(model)}"
            receipts = {receipt.key: receipt for receipt in self.store.effect_find(limit=100)}
            assert set(receipts) == set(self.model.effects), (receipts, self.model.effects)
            for key in EFFECT_KEYS:
                receipt, effect = receipts.get(key), self.model.effects.get(key)
                if effect is None:
                    assert receipt is None, f"receipt {key}: store {receipt}, model none"
                    continue
                assert receipt is not None, f"receipt {key}: model {effect}, store none"
                lease = None if receipt.lease_key is None else (
                    receipt.lease_key, receipt.lease_token, receipt.lease_owner)
                assert (receipt.fingerprint, receipt.state, lease, receipt.started_at,
                        receipt.attempts, receipt.version, receipt.updated_at) == (
                    effect.fingerprint, effect.state, effect.lease, effect.started_at,
                    effect.attempts, effect.version, effect.updated_at), (receipt, effect)

    StoreAgainstModel.TestCase.settings = settings(deadline=None)
    return StoreAgainstModel


def run(kind: str, profile: str, **overrides: Any) -> collections.Counter[str]:
    """Run the machine against a fresh store of ``kind`` with ``profile``'s settings; what
    it did (``STATS``)."""
    STATS.clear()
    if profile == "short" and kind == "postgres":
        # Each statement goes through the reply-losing proxy (~3 ms a round trip on the
        # shared machine): fewer examples keep the store tier's budget. The mutation check
        # (benchmarks.model_mutations) was run at this number.
        overrides = {"max_examples": 25, **overrides}
    with target(kind) as tgt:
        machine = make_machine(tgt)
        # LEASE_MODEL_SHRINK=0 (the mutation check): a failure is reported as found, not
        # shrunk first (shrinking a long sequence on PostgreSQL takes minutes).
        phases = list(Phase) if os.environ.get("LEASE_MODEL_SHRINK", "1") != "0" else [
            phase for phase in Phase if phase is not Phase.shrink]
        run_state_machine_as_test(machine, settings=settings(
            **{**PROFILES[profile], **overrides}, deadline=None, database=None, phases=phases,
            suppress_health_check=list(HealthCheck)))
    return collections.Counter(STATS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--stores", default="sqlite,postgres,redis")
    parser.add_argument("--profile", default="long", choices=sorted(PROFILES))
    parser.add_argument("--examples", type=int)
    args = parser.parse_args()
    overrides = {} if args.examples is None else {"max_examples": args.examples}
    for kind in args.stores.split(","):
        started = time.monotonic()
        stats = run(kind, args.profile, **overrides)
        print(f"{kind}: {args.profile} profile passed in {time.monotonic() - started:.1f} s: "
              f"{stats['examples']} examples, {stats['checks']} steps checked", flush=True)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    main()
