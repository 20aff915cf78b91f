"""Operator actions and recovery primitives of the Store contract, on every store.

force_release, requeue, find, stats, purge_older_than, sweep_expired, release with a delay and
kill run on SQLite, PostgreSQL and Redis (``store_url``) with an injected logical clock, so every
boundary is decided at an exact instant; concurrent sweepers run in separate processes on the
real clock.
"""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Iterator
from typing import Any

import pytest

from lease_celery import ConfigError, Lease, LeaseState, Store, open_store
from tests.support.policy_helpers import sweep_in_process
from tests.support.tokens import token_base

TASK: dict[str, Any] = {"task": "proj.report", "args": [42], "kwargs": {"fmt": "pdf"},
                        "options": {"task_id": "tid-42", "queue": "reports"},
                        "subtask_type": None, "immutable": False}


class RewindableClock:
    """A logical clock these tests may also set back, to look at an instant just before."""

    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> RewindableClock:
    return RewindableClock()


@pytest.fixture
def store(store_url: str, clock: RewindableClock) -> Iterator[Store]:
    with open_store(store_url, clock=clock) as opened:
        yield opened


def claim(store: Store, key: str, owner: str = "w1", ttl: float = 10,
          task: dict[str, Any] | None = None) -> Lease:
    lease = store.claim(key, owner=owner, ttl=ttl, task=task)
    assert lease is not None, f"claim of {key} refused"
    return lease


def test_force_release_makes_running_ready_and_refuses_the_holder(
        store: Store, clock: RewindableClock) -> None:
    """force_release turns a running row ready whoever holds it (reason recorded, token kept);
    the holder can no longer renew, finish, release or kill; the next claim is token 2 and not
    a takeover. Rows that are ready, done, dead or missing are not running: False, unchanged.
    A running row whose lease expired can be force-released too."""
    base = token_base(store)
    holder = claim(store, "k")
    assert store.force_release("k", reason="stuck") is True
    record = store.get("k")
    assert record is not None
    assert (record.state, record.token, record.reason) == (LeaseState.READY, base + 1, "stuck")
    assert record.expires_at is not None and record.expires_at <= clock.now
    assert store.renew(holder, ttl=10) is None
    assert store.finish(holder, "late") is False
    assert store.release(holder) is False
    assert store.kill(holder, reason="x") is False
    assert store.force_release("k", reason="again") is False
    assert store.get("k").reason == "stuck"  # type: ignore[union-attr]
    successor = claim(store, "k", owner="w2")
    assert (successor.token, successor.attempts, successor.takeovers) == (base + 2, 2, 0)

    assert store.force_release("missing", reason="x") is False
    assert store.get("missing") is None
    done = claim(store, "done")
    assert store.finish(done, 1)
    dead = claim(store, "dead")
    assert store.kill(dead, reason="x")
    for key, state in (("done", LeaseState.DONE), ("dead", LeaseState.DEAD)):
        assert store.force_release(key, reason="x") is False
        assert store.get(key).state is state  # type: ignore[union-attr]
    claim(store, "expired", ttl=1)
    clock.now += 5
    assert store.force_release("expired", reason="cleanup") is True


def test_requeue_brings_dead_back_with_a_fresh_budget(store: Store, clock: RewindableClock) -> None:
    """requeue turns a dead row ready with attempts and takeovers reset to 0, keeps its token
    and recorded task, records the reason; the next claim continues at token + 1 with
    attempts 1. Rows that are not dead (missing, ready, running, done) give None, unchanged.
    The recorded task is always the latest claim's: a claim without one clears it."""
    base = token_base(store)
    claim(store, "k", task=TASK)
    clock.now += 20  # the first owner's lease expired: the next claim is a takeover
    second = claim(store, "k", owner="w2", task=TASK)
    assert (second.token, second.attempts, second.takeovers) == (base + 2, 2, 1)
    assert store.kill(second, reason="gave up")

    record = store.requeue("k", reason="fixed upstream")
    assert record is not None
    assert (record.state, record.token, record.attempts, record.takeovers) == (
        LeaseState.READY, base + 2, 0, 0)
    assert record.reason == "fixed upstream"
    assert record.task == TASK
    assert store.requeue("k", reason="again") is None
    again = claim(store, "k", owner="w3")
    assert (again.token, again.attempts, again.takeovers) == (base + 3, 1, 0)
    assert store.get("k").task is None  # type: ignore[union-attr]  # not the previous one's
    assert store.requeue("k", reason="running") is None
    assert store.finish(again, "ok")
    assert store.requeue("k", reason="done") is None
    assert store.get("k").state is LeaseState.DONE  # type: ignore[union-attr]
    assert store.requeue("missing", reason="x") is None
    assert store.get("missing") is None


def _populate_for_find(store: Store, clock: RewindableClock) -> None:
    """One row per state, one instant apart; prefixes a: and b:, a key with LIKE wildcards."""
    claim(store, "a:1", owner="w1", ttl=100)         # running, renewed last (t=105)
    clock.now += 1
    done = claim(store, "a:2", owner="w2")
    assert store.finish(done, {"n": 2})              # done (t=101)
    clock.now += 1
    assert store.kill(claim(store, "b:1", owner="w1"), reason="x")       # dead (t=102)
    clock.now += 1
    assert store.release(claim(store, "b:2", owner="w3"), reason="y")    # ready (t=103)
    clock.now += 1
    claim(store, "a%_x", owner="w2", ttl=100)        # running (t=104)
    clock.now += 1
    record = store.get("a:1")
    assert record is not None
    assert store.renew(Lease("a:1", "w1", record.token, record.expires_at or 0.0), ttl=100)


def test_find_filters_by_state_prefix_owner_and_orders_by_update(
        store: Store, clock: RewindableClock) -> None:
    """find returns rows most recently updated first; state, prefix and owner filters combine
    (all must match); a prefix is literal text (``%`` and ``_`` are not wildcards); limit cuts
    the list; a bad limit is refused."""
    _populate_for_find(store, clock)

    def keys(**filters: Any) -> list[str]:
        return [r.key for r in store.find(**filters)]

    assert keys() == ["a:1", "a%_x", "b:2", "b:1", "a:2"]
    assert keys(state=LeaseState.RUNNING) == ["a:1", "a%_x"]
    assert keys(state=LeaseState.DONE) == ["a:2"]
    assert keys(state=LeaseState.DEAD) == ["b:1"]
    assert keys(state=LeaseState.READY) == ["b:2"]
    assert keys(prefix="a:") == ["a:1", "a:2"]
    assert keys(prefix="a%") == ["a%_x"]
    assert keys(prefix="a_") == []
    assert keys(prefix="a%_") == ["a%_x"]
    assert keys(owner="w1") == ["a:1", "b:1"]
    assert keys(owner="nobody") == []
    assert keys(state=LeaseState.RUNNING, owner="w2") == ["a%_x"]
    assert keys(prefix="b:", state=LeaseState.DEAD) == ["b:1"]
    assert keys(prefix="b:", owner="w2") == []
    assert keys(limit=2) == ["a:1", "a%_x"]
    done = store.find(state=LeaseState.DONE)[0]
    assert (done.token, done.owner, done.result) == (token_base(store) + 1, "w2", {"n": 2})
    with pytest.raises(ConfigError):
        store.find(limit=0)


def test_stats_counts_states_and_expired_running_rows(
        store: Store, clock: RewindableClock) -> None:
    """stats counts rows by state; ``expired`` counts running rows with expires_at <= now
    (the boundary instant counts as expired), never live ones or other states."""
    assert (store.stats().counts, store.stats().expired) == ({}, 0)
    claim(store, "live", ttl=50)
    claim(store, "gone", ttl=1)
    claim(store, "edge", ttl=5)
    assert store.finish(claim(store, "done"), None)
    assert store.kill(claim(store, "dead"), reason="x")
    assert store.release(claim(store, "ready"))
    clock.now += 5  # "edge" expires exactly now
    stats = store.stats()
    assert stats.counts == {"running": 3, "done": 1, "dead": 1, "ready": 1}
    assert (stats.expired, stats.total) == (2, 6)
    clock.now -= 0.5
    assert store.stats().expired == 1


def test_purge_older_than_deletes_only_old_done_and_dead_and_retires_tokens(
        store: Store, clock: RewindableClock) -> None:
    """purge_older_than(s) deletes done and dead rows last updated before now - s (strictly),
    returns how many; ready and running rows (live or expired) stay whatever their age; a
    purged key claimed again continues after its last token, also after a second purge."""
    base = token_base(store)
    assert store.finish(claim(store, "old-done"), 1)
    for _ in range(2):
        assert store.release(claim(store, "old-dead"))
    assert store.kill(claim(store, "old-dead"), reason="x")   # token base + 3
    assert store.release(claim(store, "old-ready"))
    claim(store, "old-running", ttl=1000)
    claim(store, "old-expired", ttl=1)
    clock.now = 150
    assert store.finish(claim(store, "new-done"), 2)
    clock.now = 200

    assert store.purge_older_than(60) == 2
    assert store.get("old-done") is None and store.get("old-dead") is None
    assert {r.key for r in store.find()} == {"old-ready", "old-running", "old-expired",
                                             "new-done"}
    assert store.purge_older_than(50) == 0  # updated exactly at the cutoff: kept
    assert store.purge_older_than(49.5) == 1
    assert claim(store, "old-done").token == base + 2
    recreated = claim(store, "old-dead")
    assert (recreated.token, recreated.attempts, recreated.takeovers) == (base + 4, 1, 0)
    assert store.finish(recreated, None)
    clock.now += 10
    assert store.purge_older_than(5) == 1  # old-dead again (old-done is running)
    assert claim(store, "old-dead").token == base + 5
    assert claim(store, "new-done").token == base + 2
    with pytest.raises(ConfigError):
        store.purge_older_than(-1)


def test_sweep_expired_returns_each_expired_generation_once(
        store: Store, clock: RewindableClock) -> None:
    """sweep_expired returns running rows whose lease expired (expires_at <= now) and that
    recorded task info, each generation (key + token) once; not before expiry; never rows
    without task info, live rows or finished ones; a takeover's later expiry is a new
    generation, returned again; ``limit`` bounds one call."""
    base = token_base(store)
    claim(store, "k", ttl=10, task=TASK)
    claim(store, "no-task", ttl=10)
    claim(store, "live", ttl=100, task=TASK)
    assert store.finish(claim(store, "done", ttl=10, task=TASK), None)
    clock.now = 109.999
    assert store.sweep_expired() == []
    clock.now = 110
    swept = store.sweep_expired()
    assert [(r.key, r.token, r.state) for r in swept] == [("k", base + 1, LeaseState.RUNNING)]
    assert swept[0].task == TASK
    assert store.sweep_expired() == []
    clock.now = 150
    assert store.sweep_expired() == []  # still that expired generation: already swept
    taken = claim(store, "k", owner="w2", ttl=10, task=TASK)
    assert (taken.token, taken.takeovers) == (base + 2, 1)
    # A claim without task info keeps the one recorded.
    assert store.get("k").task == TASK  # type: ignore[union-attr]
    clock.now = 160
    assert [(r.key, r.token) for r in store.sweep_expired()] == [("k", base + 2)]
    assert store.sweep_expired() == []

    for n in range(5):
        claim(store, f"many:{n}", ttl=1, task=TASK)
    clock.now = 200
    first = store.sweep_expired(limit=2)
    rest = store.sweep_expired(limit=10)
    assert len(first) == 2
    assert sorted(r.key for r in first + rest) == sorted([f"many:{n}" for n in range(5)]
                                                         + ["live"])


def test_concurrent_sweepers_in_separate_processes_share_the_work_once(
        store_url: str) -> None:
    """Four processes sweep the same 40 expired leases at the same moment (real clock, their
    own connections): every expired generation is returned to exactly one of them."""
    keys = [f"sweep:{n}" for n in range(40)]
    with open_store(store_url) as store:
        for key in keys:
            assert store.claim(key, owner="dead-worker", ttl=0.05, task=TASK) is not None
        base = token_base(store)
    time.sleep(0.1)
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(4)
    out = context.Queue()
    sweepers = [context.Process(target=sweep_in_process, args=(store_url, barrier, out))
                for _ in range(4)]
    for process in sweepers:
        process.start()
    got = [item for _ in sweepers for item in out.get(timeout=60)]
    for process in sweepers:
        process.join(30)
        assert process.exitcode == 0
    assert sorted(got) == sorted((key, base + 1) for key in keys)


def test_release_with_delay_blocks_claims_until_not_before(
        store: Store, clock: RewindableClock) -> None:
    """release(delay=5) makes the row ready with not_before = now + 5 and the reason; a claim
    before that instant is refused (the row stays ready, token kept), a claim at it succeeds
    with the next token and clears not_before; release without delay is claimable at once;
    a negative or non-finite delay is refused."""
    base = token_base(store)
    lease = claim(store, "k")
    assert store.release(lease, delay=5, reason="backing off") is True
    record = store.get("k")
    assert record is not None
    assert (record.state, record.token, record.reason) == (
        LeaseState.READY, base + 1, "backing off")
    assert record.not_before == pytest.approx(105)
    clock.now = 104.99
    assert store.claim("k", owner="w2", ttl=10) is None
    assert store.get("k").state is LeaseState.READY  # type: ignore[union-attr]
    clock.now = 105
    again = claim(store, "k", owner="w2")
    assert (again.token, again.attempts, again.takeovers) == (base + 2, 2, 0)
    assert store.get("k").not_before is None  # type: ignore[union-attr]
    assert store.release(again, delay=0) is True
    assert store.get("k").not_before is None  # type: ignore[union-attr]
    third = claim(store, "k", owner="w3")
    assert third.token == base + 3
    for bad in (-1, float("nan"), float("inf")):
        with pytest.raises(ConfigError):
            store.release(third, delay=bad)
    assert store.get("k").state is LeaseState.RUNNING  # type: ignore[union-attr]


def test_kill_by_the_current_holder_only_and_dead_is_terminal(
        store: Store, clock: RewindableClock) -> None:
    """kill marks the key dead with the reason if the lease is current; afterwards nobody can
    claim, renew, finish or release it, and a second kill is refused. A lease that expired (the
    boundary instant included) or was taken over cannot kill the key."""
    lease = claim(store, "k")
    assert store.kill(lease, reason="poison message") is True
    record = store.get("k")
    assert record is not None
    assert (record.state, record.token, record.reason) == (
        LeaseState.DEAD, token_base(store) + 1, "poison message")
    assert store.claim("k", owner="w2", ttl=10) is None
    assert store.renew(lease, ttl=10) is None
    assert store.finish(lease, 1) is False
    assert store.release(lease) is False
    assert store.kill(lease, reason="again") is False
    clock.now += 10_000
    assert store.claim("k", owner="w2", ttl=10) is None

    old = claim(store, "k2", ttl=10)
    clock.now += 10  # expires exactly now
    assert store.kill(old, reason="too late") is False
    assert store.get("k2").state is LeaseState.RUNNING  # type: ignore[union-attr]
    new = claim(store, "k2", owner="w2")
    assert store.kill(old, reason="stale") is False
    assert store.kill(new, reason="current") is True
    assert store.get("k2").reason == "current"  # type: ignore[union-attr]


def test_record_published_writes_a_ready_row_once_and_the_sweeper_finds_it_lost(
        store: Store, clock: RewindableClock) -> None:
    """``record_published`` (lease_record_at_publish) writes a key that has no row as
    ``ready`` with the message's task info, claimable at once; of two writes one wins, and a
    key with a row (running, done, or a second publish) is left alone. The first claim is
    the key's first generation (base + 1, attempt 1). Never claimed, the row is swept a grace
    period after its countdown: the message the broker lost is re-published."""
    base = token_base(store)
    assert store.record_published("pub:a", task=TASK) is True
    assert store.record_published("pub:a", task={**TASK, "args": [7]}) is False
    record = store.get("pub:a")
    assert record is not None
    assert (record.state, record.owner, record.attempts, record.task_id) == (
        LeaseState.READY, None, 0, "tid-42")
    assert record.task == TASK
    lease = claim(store, "pub:a", task=TASK)
    assert (lease.token, lease.attempts, lease.takeovers) == (base + 1, 1, 0)
    assert store.record_published("pub:a", task=TASK) is False  # a running row stays
    assert store.get("pub:a").state is LeaseState.RUNNING  # type: ignore[union-attr]
    assert store.finish(lease, {"ok": True})
    assert store.record_published("pub:a", task=TASK) is False  # so does a done one

    # Never claimed: due a grace period after the countdown, once per grace period.
    assert store.record_published("pub:b", task=TASK, countdown=5) is True
    clock.now += 5 + 2 - 0.01
    assert [r.key for r in store.sweep_expired(grace=2)] == []
    clock.now += 0.02
    assert [r.key for r in store.sweep_expired(grace=2)] == ["pub:b"]
    assert store.sweep_expired(grace=2) == []
    # A purged key's row is written again; its token continues (the claim goes above it).
    lease = claim(store, "pub:b", task=TASK)
    assert store.finish(lease, None)
    assert store.purge("pub:b")
    assert store.record_published("pub:b", task=TASK) is True
    reused = store.get("pub:b")
    assert reused is not None
    assert (reused.state, reused.owner, reused.expires_at, reused.attempts, reused.reason,
            reused.result, reused.checkpoint, reused.cancel, reused.settling) == (
        LeaseState.READY, None, None, 0, None, None, None, None, False)
    assert claim(store, "pub:b", task=TASK).token == lease.token + 1


@pytest.mark.parametrize("bad", [{"task": "x", "args": [object()]}, None])
def test_record_published_refuses_task_info_it_cannot_record(store: Store, bad: Any) -> None:
    """Task info that is not JSON (kombu's) is refused with an error naming the key, and
    nothing is written."""
    with pytest.raises(ValueError, match=r"'pub:bad'.*cannot be recorded"):
        store.record_published("pub:bad", task=bad)
    assert store.get("pub:bad") is None


def test_release_hands_the_key_to_the_next_message_and_may_give_the_attempt_back(
        store: Store, clock: RewindableClock) -> None:
    """A release for a Celery retry (or a ``replace()``) carries the message that claims the
    key next: the row's task info becomes the retry's, in the same write, and the sweeper
    re-publishes that one, not the first, and only a grace period after the retry is due.
    ``counted=False`` takes the claim's attempt back; a plain release keeps the row's task
    info and counts it. A release refused (the lease not current) changes nothing."""
    retry = {**TASK, "options": {**TASK["options"], "retries": 1}}
    lease = claim(store, "k", task=TASK)
    assert lease.attempts == 1
    assert store.release(lease, delay=30, reason="Retry in 30s", task=retry, counted=False)
    record = store.get("k")
    assert record is not None and record.state is LeaseState.READY
    assert (record.attempts, record.not_before) == (0, 130.0)
    assert record.task == retry
    clock.now = 130.5  # due, but not a grace period past it: the retry message may still come
    assert store.sweep_expired(grace=1.0) == []
    clock.now = 131.5
    assert [swept.task for swept in store.sweep_expired(grace=1.0)] == [retry]

    again = claim(store, "k", task=retry)
    assert again.attempts == 1
    stale = store.release(lease, reason="late", task=TASK, counted=False)
    assert stale is False
    assert store.release(again, reason="requeued")
    record = store.get("k")
    assert record is not None and (record.attempts, record.task) == (1, retry)


def test_a_result_comes_back_as_celerys_json_carries_it(store: Store) -> None:
    """A finish's result is kept as kombu's JSON, what Celery's default result serializer
    writes: a datetime, a UUID, a Decimal and bytes come back as they went in, on every
    store."""
    import datetime
    import decimal
    import uuid

    result = {"at": datetime.datetime(2026, 12, 6, 12, 30, tzinfo=datetime.timezone.utc),
              "id": uuid.UUID("12345678-1234-5678-1234-567812345678"),
              "amount": decimal.Decimal("12.50"), "blob": b"\x00\x01", "n": [1, 2.5, None]}
    lease = claim(store, "typed")
    assert store.finish(lease, result)
    record = store.get("typed")
    assert record is not None and record.result == result
