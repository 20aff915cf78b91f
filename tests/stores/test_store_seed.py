"""The seed article's scenario, step by step, through the public API, on every store.

Expiry logic runs on an injected logical clock (a shared mutable value), so every step is
deterministic: two workers, each with its own store object (its own connection) on one store
(a SQLite file, a PostgreSQL schema, a Redis key prefix), race for ``report:42``; renewals, the
expiry boundary, the takeover and the fenced finish are each asserted. The same bodies run on
SQLite, PostgreSQL and Redis through the ``store_url`` fixture; the freezegun tests at the end
are SQLite's alone (only SQLite reads the host clock).
"""

from __future__ import annotations

import dataclasses
import datetime
import threading
from collections.abc import Callable

from freezegun import freeze_time

from lease_celery import Lease, LeaseState, Store, open_store
from lease_celery.testing import ManualClock
from tests.support.tokens import token_base

TTL = 10




def race(calls: list[Callable[[], Lease | None]]) -> list[Lease | None]:
    """Run ``calls`` in threads released together by a barrier; return their results in order."""
    barrier = threading.Barrier(len(calls))
    results: list[Lease | None] = [None] * len(calls)
    errors: list[BaseException] = []

    def run(index: int) -> None:
        try:
            barrier.wait(timeout=10)
            results[index] = calls[index]()
        except BaseException as exc:  # surfaced below, in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert not any(thread.is_alive() for thread in threads), "a racing claim never returned"
    if errors:
        raise errors[0]
    return results


def test_simultaneous_claims_have_exactly_one_winner_every_time(
    stores: list[Store], clock: ManualClock
) -> None:
    """Two workers with separate connections claiming the same fresh key at the same moment:
    exactly one gets a Lease (token base + 1, expires_at = now + ttl), the other gets None; the row
    names the winner. Repeated on 50 fresh keys, so a single lucky ordering proves nothing."""
    a, b = stores
    for i in range(50):
        key = f"report:{i}"
        got = race(
            [
                lambda key=key: a.claim(key, owner="worker-a", ttl=TTL),
                lambda key=key: b.claim(key, owner="worker-b", ttl=TTL),
            ]
        )
        winners = [lease for lease in got if lease is not None]
        assert len(winners) == 1, f"{key}: {got}"
        (winner,) = winners
        assert winner.key == key
        base = token_base(a)
        assert winner.token == base + 1
        assert winner.expires_at == 110
        record = a.get(key)
        assert record is not None
        assert record.state is LeaseState.RUNNING
        assert (record.owner, record.token, record.attempts) == (winner.owner, base + 1, 1)


def test_seed_article_scenario(stores: list[Store], clock: ManualClock) -> None:
    """The seed article end to end: race at t=100 (one winner, token 1, expires 110); renew at
    103 moves the deadline to 113; the loser's claim at 110 fails; at 113 (expires_at == now
    counts as expired) the old holder can neither renew nor finish; the loser takes over with
    token 2; the stale finish (token 1) is refused, the fresh one accepted once, and the row
    shows done / token 2 / the new owner / the JSON-round-tripped result."""
    key = "report:42"
    owners = ["worker-a", "worker-b"]

    # t=100: both claim at once, exactly one wins.
    clock.now = 100
    got = race(
        [
            lambda: stores[0].claim(key, owner=owners[0], ttl=TTL),
            lambda: stores[1].claim(key, owner=owners[1], ttl=TTL),
        ]
    )
    assert sum(lease is not None for lease in got) == 1, got
    w = 0 if got[0] is not None else 1  # index of the winner
    winner_store, loser_store = stores[w], stores[1 - w]
    loser_owner = owners[1 - w]
    lease = got[w]
    base = token_base(winner_store)
    assert lease == Lease(key=key, owner=owners[w], token=base + 1, expires_at=110,
                          fence=lease.fence)

    # t=103: the holder renews; the deadline moves to 103 + 10.
    clock.now = 103
    renewed = winner_store.renew(lease, ttl=TTL)
    assert renewed == Lease(key=key, owner=owners[w], token=base + 1, expires_at=113,
                            fence=lease.fence)
    assert winner_store.get(key).expires_at == 113

    # t=110: the first deadline has passed but the renewed one has not: the loser still loses.
    clock.now = 110
    assert loser_store.claim(key, owner=loser_owner, ttl=TTL) is None

    # t=113: expires_at == now is expired. The old holder can neither renew nor finish,
    # and its refused attempts leave the row untouched.
    clock.now = 113
    before = winner_store.get(key)
    assert winner_store.renew(renewed, ttl=TTL) is None
    assert winner_store.finish(renewed, {"stale": True}) is False
    assert winner_store.get(key) == before
    assert before.state is LeaseState.RUNNING and before.token == base + 1

    # The other worker takes over with a new generation.
    fresh = loser_store.claim(key, owner=loser_owner, ttl=TTL)
    assert fresh == Lease(key=key, owner=loser_owner, token=base + 2, expires_at=123,
                          fence=fresh.fence)
    assert fresh.fence > lease.fence  # the store-wide fence grows with every claim

    # The stale holder wakes up: its finish (token 1, either Lease object) is refused.
    assert winner_store.finish(renewed, {"stale": True}) is False
    assert winner_store.finish(lease, {"stale": True}) is False
    record = loser_store.get(key)
    assert (record.state, record.owner, record.token) == (
        LeaseState.RUNNING, loser_owner, base + 2)
    assert record.result is None

    # The fresh holder's finish is accepted exactly once.
    result = {"report": 42, "rows": [1, 2.5, "three", None, True], "nested": {"k": ["v"]}}
    assert loser_store.finish(fresh, result) is True
    assert loser_store.finish(fresh, {"second": "finish"}) is False

    final = winner_store.get(key)
    assert final.state is LeaseState.DONE
    assert final.token == base + 2
    assert final.owner == loser_owner
    assert final.attempts == 2
    assert final.result == result


def test_reused_owner_name_is_fenced_by_the_token_alone(
    stores: list[Store], clock: ManualClock
) -> None:
    """The same owner name claiming again after its lease expired gets token n+1; the old Lease
    (token n) is refused by renew and finish even while the new lease is live, including a copy
    identical to the new lease except for the token; the new Lease then finishes."""
    store = stores[0]
    key = "report:reused-owner"
    clock.now = 100
    old = store.claim(key, owner="w", ttl=TTL)
    assert old is not None
    n = old.token

    clock.now = 110  # old expired at exactly now
    new = store.claim(key, owner="w", ttl=TTL)
    assert new is not None
    assert new.owner == old.owner == "w"
    assert new.token == n + 1

    clock.now = 111  # the new lease is live; only the token tells the two apart
    same_but_token = dataclasses.replace(new, token=n)
    before = store.get(key)
    assert store.renew(old, ttl=TTL) is None
    assert store.renew(same_but_token, ttl=TTL) is None
    assert store.finish(old, "old") is False
    assert store.finish(same_but_token, "old") is False
    assert store.release(old) is False
    assert store.get(key) == before

    assert store.finish(new, "new") is True
    record = store.get(key)
    assert (record.state, record.token, record.owner, record.result) == (
        LeaseState.DONE,
        n + 1,
        "w",
        "new",
    )


def test_release_gives_the_key_back_and_tokens_never_restart(
    stores: list[Store], clock: ManualClock
) -> None:
    """release() of the current lease returns True and leaves state ready with the token kept;
    the released lease can no longer renew, finish or release; the next claim (even at the same
    instant) gets token + 1; releasing a lease that is not current (expired, or superseded by a
    newer token) returns False and leaves the row unchanged."""
    a, b = stores
    key = "report:release"
    clock.now = 100
    first = a.claim(key, owner="worker-a", ttl=TTL)
    base = token_base(a)
    assert first is not None and first.token == base + 1

    assert a.release(first) is True
    record = a.get(key)
    assert record.state is LeaseState.READY
    assert record.token == base + 1

    assert a.renew(first, ttl=TTL) is None
    assert a.finish(first, "late") is False
    assert a.release(first) is False
    assert a.get(key) == record

    second = b.claim(key, owner="worker-b", ttl=TTL)
    assert second is not None
    assert second.token == base + 2
    assert a.release(first) is False  # superseded lease: refused, row untouched
    assert b.get(key).owner == "worker-b"

    clock.now = 110  # second expires exactly now
    before = b.get(key)
    assert b.release(second) is False
    assert b.get(key) == before

    third = a.claim(key, owner="worker-a", ttl=TTL)
    assert third is not None and third.token == base + 3
    assert a.release(third) is True
    fourth = a.claim(key, owner="worker-a", ttl=TTL)
    assert fourth is not None and fourth.token == base + 4
    assert a.get(key).attempts == 4


def test_done_key_cannot_be_claimed_again(stores: list[Store], clock: ManualClock) -> None:
    """Once a result is accepted the key is done: later claims by anyone return None, no matter
    how much time passes, and the row (result, token, owner) stays as it was."""
    a, b = stores
    key = "report:done"
    clock.now = 100
    lease = a.claim(key, owner="worker-a", ttl=TTL)
    assert lease is not None
    assert a.finish(lease, [1, 2, 3]) is True
    done = a.get(key)
    assert done.state is LeaseState.DONE

    for now in (100, 110, 10_000, 1e9):
        clock.now = now
        assert b.claim(key, owner="worker-b", ttl=TTL) is None
        assert a.claim(key, owner="worker-a", ttl=TTL) is None
    assert b.get(key) == done
    assert done.result == [1, 2, 3]
    assert done.token == token_base(a) + 1


FROZEN_AT = datetime.datetime(2030, 1, 1, 12, 0, 0)


def _expiry_at_the_boundary(store: Store, frozen, key: str) -> None:
    """Shared body of the freezegun tests: claim at t with ttl 10; still held at t + 9.999;
    at t + 10 another owner's claim succeeds and the old holder's finish is refused."""
    t = FROZEN_AT.replace(tzinfo=datetime.timezone.utc).timestamp()
    assert store.now() == t
    old = store.claim(key, owner="worker-a", ttl=TTL)
    assert old is not None
    assert old.expires_at == t + TTL

    frozen.move_to(FROZEN_AT + datetime.timedelta(seconds=9.999))
    assert store.claim(key, owner="worker-b", ttl=TTL) is None

    frozen.move_to(FROZEN_AT + datetime.timedelta(seconds=TTL))  # expires_at == now
    new = store.claim(key, owner="worker-b", ttl=TTL)
    assert new is not None
    assert new.token == old.token + 1
    assert new.expires_at == t + 2 * TTL
    assert store.finish(old, "stale") is False
    assert store.finish(new, "fresh") is True
    record = store.get(key)
    assert (record.state, record.owner, record.result) == (LeaseState.DONE, "worker-b", "fresh")


def test_freezegun_expiry_boundary_store_opened_inside_freeze(sqlite_url: str) -> None:
    """SQLite only: with the default clock (none injected) a store opened under freeze_time
    follows the frozen time, because SQLite's authority clock is the host's: a ttl=10 lease is
    still held at t+9.999 and expired at exactly t+10, where another owner's claim succeeds and
    the old finish is refused."""
    with freeze_time(FROZEN_AT) as frozen:
        store = open_store(sqlite_url)
        try:
            _expiry_at_the_boundary(store, frozen, "report:freeze-inside")
        finally:
            store.close()


def test_freezegun_expiry_boundary_store_opened_before_freeze(sqlite_url: str) -> None:
    """SQLite only: freeze_time around single-threaded store calls (DESIGN section 4) must
    govern the default clock even when the store object was opened before the freeze, as a
    fixture would: the store reads the time at each call, not a reference to time.time taken at
    open."""
    store = open_store(sqlite_url)
    try:
        with freeze_time(FROZEN_AT) as frozen:
            _expiry_at_the_boundary(store, frozen, "report:freeze-around-calls")
    finally:
        store.close()
