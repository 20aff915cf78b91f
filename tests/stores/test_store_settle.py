"""The store side of the settle protocol and the no-orphan sweep (issue 9), on every store.

A finished key stays *settling* until its owner confirms that Celery stored the outcome; past
the settle deadline unconfirmed, exactly one delivery may complete it. The sweeper returns
every row nobody will run otherwise (an expired lease, a settle phase past its deadline, a
ready row unclaimed for a grace period), once per grace period, and a mark whose sweeper died
before re-publishing expires.
"""

from __future__ import annotations

import pytest

from lease_celery import LeaseState, Store
from lease_celery.errors import ConfigError
from lease_celery.testing import ManualClock
from tests.support.tokens import token_base

TASK = {"task": "proj.tasks.build", "args": [1], "kwargs": {}, "options": {"task_id": "t-1"}}
GRACE = 30.0


@pytest.fixture
def store(stores: list[Store]) -> Store:
    return stores[0]


def claim(store: Store, key: str, owner: str = "w1", ttl: float = 10, task: object = TASK):
    lease = store.claim(key, owner=owner, ttl=ttl, task=task)  # type: ignore[arg-type]
    assert lease is not None, f"claim of {key} by {owner} refused"
    return lease


def swept(store: Store) -> list[tuple[str, int]]:
    return [(r.key, r.token) for r in store.sweep_expired(grace=GRACE)]


def test_finish_with_settle_keeps_the_key_settling_until_its_owner_confirms(
        store: Store, clock: ManualClock) -> None:
    """finish(settle_within=5): done with the result, settling, deadline now + 5, task info
    kept; no claim can take it; the owner may renew the settle deadline; settle() ends the
    phase (drops the task info) and a second settle is refused for nobody else's sake."""
    lease = claim(store, "k")
    assert store.finish(lease, {"n": 1}, settle_within=5)
    record = store.get("k")
    assert record is not None
    assert (record.state, record.settling, record.result, record.token) == (
        LeaseState.DONE, True, {"n": 1}, token_base(store) + 1)
    assert record.expires_at == pytest.approx(105)
    assert record.task == TASK and record.task_id == "t-1"
    assert store.claim("k", owner="w2", ttl=10) is None
    assert store.claim_settlement("k", owner="w2", ttl=10) is None  # its owner is still there
    clock.advance(4)
    renewed = store.renew(lease, ttl=5)
    assert renewed is not None and renewed.expires_at == pytest.approx(109)
    clock.advance(4)  # 108: past the first deadline, inside the renewed one
    assert store.claim_settlement("k", owner="w2", ttl=10) is None
    assert store.settle(lease) is True
    record = store.get("k")
    assert record is not None
    # Settled: of its task info, the row keeps only the task id (a duplicate under another
    # id is answered, one under the same id dropped).
    assert (record.state, record.settling, record.result, record.task) == (
        LeaseState.DONE, False, {"n": 1}, {"options": {"task_id": "t-1"}})
    assert record.task_id == "t-1"
    assert store.renew(lease, ttl=5) is None  # settled: nothing left to hold
    clock.advance(100)
    assert store.claim_settlement("k", owner="w2", ttl=10) is None
    assert store.claim("k", owner="w2", ttl=10) is None


def test_finish_without_settle_is_settled_at_once(store: Store) -> None:
    """A plain finish (no result backend to wait for) leaves nothing to settle or sweep."""
    lease = claim(store, "k")
    assert store.finish(lease, 7)
    record = store.get("k")
    assert record is not None
    assert (record.state, record.settling, record.task) == (
        LeaseState.DONE, False, {"options": {"task_id": "t-1"}})  # only the task id is kept
    assert store.claim_settlement("k", owner="w2", ttl=10) is None


def test_a_settle_phase_past_its_deadline_is_completed_by_exactly_one_delivery(
        stores: list[Store], clock: ManualClock) -> None:
    """The owner died between finish and Celery's result write: at the deadline (the boundary
    instant counts as past) one delivery takes the settlement over, same token, new owner and
    deadline; a second one is refused while the completer holds it; the dead owner's late
    confirmation is refused, the completer's accepted; the completer may then renew nothing."""
    first, second = stores
    lease = claim(first, "k")
    assert first.finish(lease, "accepted", settle_within=5)
    clock.advance(4.999)
    assert second.claim_settlement("k", owner="w2", ttl=10) is None
    clock.advance(0.001)
    completer = second.claim_settlement("k", owner="w2", ttl=10)
    assert completer is not None
    assert (completer.key, completer.owner, completer.token) == ("k", "w2", token_base(first) + 1)
    assert completer.expires_at == pytest.approx(115)
    assert first.claim_settlement("k", owner="w3", ttl=10) is None
    record = first.get("k")
    assert record is not None
    assert (record.state, record.owner, record.result, record.settling) == (
        LeaseState.DONE, "w2", "accepted", True)
    assert first.settle(lease) is False  # the first owner no longer settles this key
    assert second.settle_many([completer]) == [True]
    assert first.get("k").settling is False  # type: ignore[union-attr]


def test_a_killed_key_settles_its_failure_like_a_finish(
        store: Store, clock: ManualClock) -> None:
    """kill(settle_within=…): dead, settling, the reason and the task info kept (requeue needs
    it); completed past the deadline like a finish; settle keeps the task info."""
    lease = claim(store, "k")
    assert store.kill(lease, reason="soft time limit exceeded", settle_within=5)
    record = store.get("k")
    assert record is not None
    assert (record.state, record.settling, record.reason) == (
        LeaseState.DEAD, True, "soft time limit exceeded")
    clock.advance(5)
    completer = store.claim_settlement("k", owner="w2", ttl=10)
    assert completer is not None and completer.token == token_base(store) + 1
    assert store.settle(completer)
    record = store.get("k")
    assert record is not None
    assert (record.state, record.settling, record.task) == (LeaseState.DEAD, False, TASK)


def test_settle_refuses_leases_that_are_not_settling(store: Store) -> None:
    """settle_many answers each lease on its own: a running lease, another owner's or token's,
    and a key with no row are refused; bad settle_within values are refused before writing."""
    running = claim(store, "running")
    done = claim(store, "done")
    assert store.finish(done, None, settle_within=5)
    other = type(done)(done.key, "someone-else", done.token, done.expires_at)
    answers = store.settle_many([running, other, done])
    assert answers == [False, False, True]
    assert store.settle_many([]) == []
    for bad in (0, -1, float("nan")):
        with pytest.raises(ConfigError):
            store.finish(running, None, settle_within=bad)
    assert store.get("running").state is LeaseState.RUNNING  # type: ignore[union-attr]


def test_a_sweepers_mark_expires_so_a_sweeper_that_died_loses_nothing(
        store: Store, clock: ManualClock) -> None:
    """Issue 9 (lost: a sweeper killed between its mark and its re-publish): a marked expired
    generation is not returned again within the grace period, and is returned again once it
    passed, as long as nobody claimed it; once per grace period, not once ever."""
    base = token_base(store)
    claim(store, "k")
    clock.advance(10)
    assert swept(store) == [("k", base + 1)]  # ... and this sweeper dies before it re-publishes
    clock.advance(GRACE - 0.5)
    assert swept(store) == []
    clock.advance(0.5)
    assert swept(store) == [("k", base + 1)]
    assert swept(store) == []
    clock.advance(GRACE)
    assert swept(store) == [("k", base + 1)]
    taken = claim(store, "k", owner="w2")  # the re-published task arrives: a takeover
    assert taken.token == base + 2
    clock.advance(GRACE)
    assert swept(store) == [("k", base + 2)]  # that generation died too


def test_a_ready_row_nobody_claims_is_re_published_after_the_grace_period(
        store: Store, clock: ManualClock) -> None:
    """Issue 9 (lost: a released key whose message is gone): a row released (or backing off)
    that nobody claimed a grace period after it became claimable is returned, once per grace
    period; a claim ends that; a row released with no task info is never returned."""
    base = token_base(store)
    assert store.release(claim(store, "released"), reason="lease lost locally")
    assert store.release(claim(store, "backoff"), delay=20, reason="attempt 1 failed")
    assert store.release(claim(store, "no-task", task=None), reason="direct call")
    clock.advance(GRACE - 0.5)
    assert swept(store) == []
    clock.advance(0.5)
    assert swept(store) == [("released", base + 1)]
    clock.advance(19.5)  # backoff's not_before (120) + grace = 150
    assert swept(store) == []
    clock.advance(0.5)
    assert swept(store) == [("backoff", base + 1)]
    clock.advance(GRACE - 20)  # 160: "released" was marked at 130 -> due again
    assert swept(store) == [("released", base + 1)]
    claim(store, "released", owner="w2")
    claim(store, "backoff", owner="w2")
    clock.advance(5)
    assert swept(store) == []


def test_a_settle_phase_past_its_deadline_is_swept_and_settled_rows_never_are(
        store: Store, clock: ManualClock) -> None:
    """A settling row past its deadline is returned (re-published, it completes the key); a
    settled one, a plain finish and a dead key are never returned."""
    base = token_base(store)
    settling = claim(store, "settling")
    assert store.finish(settling, 1, settle_within=5)
    settled = claim(store, "settled")
    assert store.finish(settled, 2, settle_within=5)
    assert store.settle(settled)
    assert store.finish(claim(store, "plain"), 3)
    assert store.kill(claim(store, "dead"), reason="gave up")
    clock.advance(4.9)
    assert swept(store) == []
    clock.advance(0.1)
    assert swept(store) == [("settling", base + 1)]
    clock.advance(GRACE)
    assert swept(store) == [("settling", base + 1)]
    completer = store.claim_settlement("settling", owner="w2", ttl=5)
    assert completer is not None and store.settle(completer)
    clock.advance(GRACE)
    assert swept(store) == []


def test_a_failed_republish_is_unmarked_and_returned_by_the_next_sweep(
        store: Store, clock: ManualClock) -> None:
    """sweep_unmark (the broker refused the re-publish) makes the row due at the next sweep,
    for an expired lease and for a ready row alike; a wrong token unmarks nothing."""
    base = token_base(store)
    claim(store, "running")
    assert store.release(claim(store, "ready"), reason="lost")
    clock.advance(GRACE)
    assert sorted(swept(store)) == [("ready", base + 1), ("running", base + 1)]
    assert store.sweep_unmark("running", base + 7) is False
    assert store.sweep_unmark("running", base + 1) is True
    assert store.sweep_unmark("ready", base + 1) is True
    assert sorted(swept(store)) == [("ready", base + 1), ("running", base + 1)]
    assert swept(store) == []
    with pytest.raises(ConfigError):
        store.sweep_expired(grace=-1)


def test_a_settled_redis_row_is_kept_in_the_compact_encoding(redis_store_url: str) -> None:
    """Redis: the task info (longer than Redis's compact-hash limit) is dropped when the key
    settles, and the hash is rewritten, so a settled row takes the compact encoding again."""
    import redis

    from lease_celery import open_store

    task = {**TASK, "kwargs": {"padding": "x" * 200}}
    with open_store(redis_store_url) as store:
        client = redis.Redis.from_url(redis_store_url.split("?")[0])
        prefix = redis_store_url.split("prefix=")[1]
        for key, settle in (("plain", None), ("settled", 5.0)):
            lease = store.claim(key, owner="w", ttl=10, task=task)
            assert lease is not None
            assert client.object("encoding", f"{prefix}lease:{key}") == b"hashtable"
            assert store.finish(lease, {"n": 1}, settle_within=settle)
            if settle is not None:
                assert store.settle(lease)
            assert client.object("encoding", f"{prefix}lease:{key}") in (b"listpack", b"ziplist")
            record = store.get(key)
            assert record is not None and record.result == {"n": 1}
            assert record.task == {"options": {"task_id": "t-1"}}  # only the id is kept
            assert (record.state, record.token, record.settling) == (
                LeaseState.DONE, token_base(store) + 1, False)


@pytest.mark.parametrize("settle_within", [None, 5.0])
def test_a_settled_done_row_keeps_its_delivery_context(store: Store,
                                                       settle_within: float | None) -> None:
    """Of its task info a settled done row keeps the task id and the delivery's context: a
    delivery of the same id in the same context is a copy of the one that ran (dropped), one
    in another context is the same frozen signature applied elsewhere (answered)."""
    task = {**TASK, "context": "c0ffee"}
    for key, settle_many in (("by-settle", False), ("by-settle-many", True)):
        lease = store.claim(key, owner="w", ttl=10, task=task)
        assert lease is not None
        assert store.finish(lease, {"n": 1}, settle_within=settle_within)
        if settle_within is not None:
            assert (store.settle_many([lease]) == [True] if settle_many
                    else store.settle(lease))
        record = store.get(key)
        assert record is not None and record.state is LeaseState.DONE and not record.settling
        assert record.task == {"options": {"task_id": "t-1"}, "context": "c0ffee"}
        assert (record.task_id, record.context) == ("t-1", "c0ffee")


def test_a_settle_confirmed_twice_by_its_own_lease_is_answered_true_both_times(
        store: Store, clock: ManualClock) -> None:
    """The confirmation is idempotent (the heartbeat sends it again after an error): the lease
    that settled its key is told so when it asks again, on every store, as Redis answered and
    PostgreSQL answered a re-sent one; SQLite and PostgreSQL said False, which the heartbeat
    logs as "completed by another delivery". A completer's settle is another matter: the
    first owner's confirmation after it is refused. (Found by the reference model,
    tests/stores/test_model.py.)"""
    lease = claim(store, "k")
    assert store.finish(lease, 1, settle_within=5)
    assert store.settle(lease) is True
    assert store.settle(lease) is True
    assert store.settle_many([lease, lease]) == [True, True]
    other = claim(store, "other")
    assert store.kill(other, reason="boom", settle_within=5)
    clock.advance(5)
    completer = store.claim_settlement("other", owner="w2", ttl=10)
    assert completer is not None and store.settle(completer) is True
    assert store.settle(other) is False  # settled, but by the completer
