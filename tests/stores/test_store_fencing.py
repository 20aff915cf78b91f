"""The fencing rule on every store: tokens never restart, the deadline instant is expired, and
every refusal leaves the row exactly as it was.

Each test runs on SQLite, PostgreSQL and Redis (``store_url``) with an injected logical clock,
so expiry is decided at exact instants; only the claim-versus-purge race uses the real clock.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
import threading
import time
from collections.abc import Callable

import pytest

from lease_celery import Lease, LeaseRecord, LeaseState, Store, open_store
from lease_celery.testing import ManualClock
from tests.support.tokens import token_base

TTL = 10.0




def _get(store: Store, key: str) -> LeaseRecord:
    record = store.get(key)
    assert record is not None, f"no row for {key!r}"
    return record


# -- tokens across release, purge and re-creation --------------------------------------------


def test_purge_of_a_missing_key_returns_false(stores: list[Store]) -> None:
    """purge() of a key that never had a row returns False and creates nothing."""
    store = stores[0]
    assert store.purge("report:never") is False
    assert store.get("report:never") is None


def test_live_lease_is_never_purged(stores: list[Store], clock: ManualClock) -> None:
    """A running lease before its deadline is not purged: purge() returns False (at the claim
    instant and just before the deadline) and the row is identical afterwards; the holder can
    still finish."""
    a, b = stores
    key = "report:live"
    lease = a.claim(key, owner="worker-a", ttl=TTL)
    assert lease is not None
    before = _get(a, key)
    for now in (100.0, 105.0, 109.999):
        clock.now = now
        assert b.purge(key) is False
        assert a.purge(key) is False
        assert _get(b, key) == before
    assert a.finish(lease, "kept") is True


def test_purge_and_recreate_never_restarts_the_token(
    stores: list[Store], clock: ManualClock
) -> None:
    """Over several cycles a key is claimed, left (finished / released / expired at exactly its
    deadline / finished again), and purged: each purge of the non-held row returns True, get()
    is then None, a second purge returns False, and the next claim gets the last token + 1 with
    a fresh row (attempts 1, no result); the old leases can neither renew nor finish the new
    row. Tokens across all cycles are base + 1, base + 2, base + 3, … (base: the store's
    floor, 0 on the SQL stores)."""
    a, b = stores
    key = "report:recreated"
    leave: list[Callable[[Store, Lease], None]] = [
        lambda s, lease: _assert_true(s.finish(lease, {"v": lease.token})),
        lambda s, lease: _assert_true(s.release(lease)),
        lambda s, lease: setattr(clock, "now", lease.expires_at),  # expired at exactly now
        lambda s, lease: _assert_true(s.finish(lease, None)),
    ]
    tokens: list[int] = []
    old_leases: list[Lease] = []
    for cycle, how in enumerate(leave * 2):
        store = stores[cycle % 2]
        lease = store.claim(key, owner=f"worker-{cycle % 2}", ttl=TTL)
        assert lease is not None, f"cycle {cycle}: claim after purge refused"
        tokens.append(lease.token)
        record = _get(store, key)
        assert (record.state, record.token, record.attempts, record.result) == (
            LeaseState.RUNNING, lease.token, 1, None)
        for old in old_leases:
            assert store.renew(old, ttl=TTL) is None
            assert store.finish(old, "stale") is False
        assert _get(store, key) == record
        how(store, lease)
        old_leases.append(lease)

        assert b.purge(key) is True, f"cycle {cycle}: purge of a row that is not held refused"
        assert a.get(key) is None and b.get(key) is None
        assert a.purge(key) is False
        clock.now += 1
    base = token_base(a)
    assert tokens == list(range(base + 1, base + len(tokens) + 1))


def test_purge_of_an_expired_lease_retires_its_token(
    stores: list[Store], clock: ManualClock
) -> None:
    """A running lease whose deadline has passed may be purged; the purged holder can no
    longer renew, finish or release (there is no row), and a later claim continues at its
    token + 1 rather than at the key's first token."""
    a, b = stores
    key = "report:expired-purge"
    first = a.claim(key, owner="worker-a", ttl=TTL)
    assert first is not None
    clock.now = 110.0
    second = b.claim(key, owner="worker-b", ttl=TTL)  # token base + 2, expires 120
    base = token_base(b)
    assert second is not None and second.token == base + 2
    clock.now = 125.0
    assert a.purge(key) is True
    assert b.renew(second, ttl=TTL) is None
    assert b.finish(second, "late") is False
    assert b.release(second) is False
    assert a.get(key) is None  # the refusals re-created nothing
    third = a.claim(key, owner="worker-a", ttl=TTL)
    assert third is not None and third.token == base + 3


def _assert_true(value: object) -> None:
    assert value is True


# At b0be69c PostgreSQL failed this reliably: a claim that waited on a concurrent purge's DELETE
# inserted with the retired token read in its stale snapshot, restarting the key at token 1.
def test_claims_racing_purges_never_reuse_a_token(store_url: str) -> None:
    """Real clock, real concurrency: one thread claims and releases a key in a loop while
    another purges it in a loop (each with its own store). Every token the claimer is granted
    is larger than the one before — a purge racing a claim must not let the key restart."""
    claimer_store, purger_store = open_store(store_url), open_store(store_url)
    key = "report:purge-race"
    claimer_store.get(key)
    purger_store.get(key)
    tokens: list[int] = []
    purged = 0
    errors: list[BaseException] = []
    started = time.monotonic()

    def racing() -> bool:
        """1.5 s, and on until each side made more than 10 moves (a loaded machine, SQLite's
        busy waits) within 20 s: fewer would race too seldom to mean anything."""
        spent = time.monotonic() - started
        return spent < 1.5 or (spent < 20 and (purged <= 10 or len(tokens) <= 10))

    def claimer() -> None:
        try:
            while racing():
                lease = claimer_store.claim(key, owner="claimer", ttl=30)
                if lease is not None:
                    tokens.append(lease.token)
                    assert claimer_store.release(lease) is True
                time.sleep(random.uniform(0, 0.001))  # leave the purger a ready row now and then
        except BaseException as exc:
            errors.append(exc)

    def purger() -> None:
        nonlocal purged
        try:
            while racing():
                purged += purger_store.purge(key)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=claimer), threading.Thread(target=purger)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=30)
    finally:
        claimer_store.close()
        purger_store.close()
    assert not errors, errors
    assert purged > 10 and len(tokens) > 10, (purged, len(tokens))
    backwards = [(t0, t1) for t0, t1 in itertools.pairwise(tokens) if t1 <= t0]
    assert not backwards, (
        f"{len(backwards)} of {len(tokens)} claims got a token not above the previous one "
        f"(first: {backwards[:5]})")


# -- the deadline instant ---------------------------------------------------------------------


EPOCHS = [100.0, 1_800_000_000.0]  # a small logical time and an epoch-scale one


@pytest.mark.parametrize("t0", EPOCHS, ids=["t100", "epoch"])
def test_one_millisecond_before_the_deadline_the_lease_is_held(
    stores: list[Store], clock: ManualClock, t0: float
) -> None:
    """At deadline - 0.001 the lease is still live: another owner's claim and a purge are
    refused (row unchanged), and the holder's renew (deadline moves to now + ttl), finish and
    release each succeed (on three keys claimed at the same instant)."""
    a, b = stores
    clock.now = t0
    leases = {op: a.claim(f"report:{op}", owner="worker-a", ttl=TTL)
              for op in ("renew", "finish", "release")}
    assert all(lease is not None and lease.expires_at == t0 + TTL for lease in leases.values())

    clock.now = t0 + TTL - 0.001
    for key in (f"report:{op}" for op in leases):
        before = _get(a, key)
        assert b.claim(key, owner="worker-b", ttl=TTL) is None
        assert b.purge(key) is False
        assert _get(a, key) == before

    renewed = a.renew(leases["renew"], ttl=TTL)
    assert renewed is not None
    assert renewed.expires_at == pytest.approx(clock.now + TTL, abs=1e-6)
    assert renewed.expires_at > t0 + TTL
    assert a.finish(leases["finish"], "in time") is True
    assert a.release(leases["release"]) is True
    assert _get(b, "report:renew").expires_at == renewed.expires_at
    assert _get(b, "report:finish").state is LeaseState.DONE
    assert _get(b, "report:release").state is LeaseState.READY


@pytest.mark.parametrize("t0", EPOCHS, ids=["t100", "epoch"])
def test_at_the_deadline_the_lease_is_expired(
    stores: list[Store], clock: ManualClock, t0: float
) -> None:
    """expires_at == now counts as expired: at exactly the deadline the holder's renew returns
    None and finish/release return False, each leaving the row unchanged; another owner's claim
    then succeeds with token + 1 and a deadline of now + ttl, and the old lease still cannot
    finish it."""
    a, b = stores
    clock.now = t0
    lease = a.claim("report:boundary", owner="worker-a", ttl=TTL)
    assert lease is not None

    clock.now = lease.expires_at
    before = _get(a, "report:boundary")
    assert a.renew(lease, ttl=TTL) is None
    assert _get(a, "report:boundary") == before
    assert a.finish(lease, "too late") is False
    assert _get(a, "report:boundary") == before
    assert a.release(lease) is False
    assert _get(a, "report:boundary") == before
    assert a.renew_many([lease], ttl=TTL) == [None]
    assert _get(a, "report:boundary") == before

    taken = b.claim("report:boundary", owner="worker-b", ttl=TTL)
    assert taken is not None
    assert (taken.token, taken.expires_at) == (lease.token + 1, t0 + 2 * TTL)
    assert a.finish(lease, "too late") is False
    record = _get(b, "report:boundary")
    assert (record.state, record.owner, record.token) == (
        LeaseState.RUNNING, "worker-b", token_base(b) + 2)


# -- refusals leave the row unchanged ---------------------------------------------------------


def _refusals(lease: Lease) -> dict[str, Lease]:
    """Leases that are not ``lease``: another owner, the next and the previous token."""
    return {
        "wrong owner": dataclasses.replace(lease, owner="intruder"),
        "wrong token (next)": dataclasses.replace(lease, token=lease.token + 1),
        "wrong token (previous)": dataclasses.replace(lease, token=lease.token - 1),
        "wrong key": dataclasses.replace(lease, key="report:other"),
    }


def test_wrong_owner_or_token_is_refused_and_changes_nothing(
    stores: list[Store], clock: ManualClock
) -> None:
    """While a lease is live, renew / finish / release with the right key but another owner,
    the next or previous token, or a key with no row, are each refused (None / False) and
    leave the row exactly as it was (and create no row for the other key); the real lease is
    then still current and renews."""
    a, b = stores
    key = "report:refusals"
    first = a.claim(key, owner="worker-a", ttl=TTL)
    assert first is not None and a.release(first) is True
    lease = a.claim(key, owner="worker-a", ttl=TTL)  # token 2, so token - 1 is a real old one
    assert lease is not None and lease.token == token_base(a) + 2
    clock.now = 105.0
    before = _get(a, key)
    for why, wrong in _refusals(lease).items():
        assert b.renew(wrong, ttl=TTL) is None, why
        assert _get(a, key) == before, why
        assert b.renew_many([wrong], ttl=TTL) == [None], why
        assert _get(a, key) == before, why
        assert b.finish(wrong, {"by": why}) is False, why
        assert _get(a, key) == before, why
        assert b.release(wrong) is False, why
        assert _get(a, key) == before, why
    assert a.get("report:other") is None
    renewed = a.renew(lease, ttl=TTL)
    assert renewed is not None and renewed.expires_at == 115.0


def test_expired_released_and_finished_leases_are_refused_and_change_nothing(
    stores: list[Store], clock: ManualClock
) -> None:
    """A lease past its deadline, a released lease and a finished lease are each refused by
    renew, finish and release, and every refusal leaves the row as it was (a refused finish
    does not overwrite the accepted result)."""
    a, b = stores
    expired = a.claim("report:expired", owner="worker-a", ttl=5)
    released = a.claim("report:released", owner="worker-a", ttl=TTL)
    finished = a.claim("report:finished", owner="worker-a", ttl=TTL)
    assert expired and released and finished
    assert a.release(released) is True
    assert a.finish(finished, {"accepted": True}) is True
    clock.now = 106.0
    for lease in (expired, released, finished):
        before = _get(a, lease.key)
        assert a.renew(lease, ttl=TTL) is None, lease.key
        assert a.finish(lease, {"accepted": False}) is False, lease.key
        assert a.release(lease) is False, lease.key
        assert _get(b, lease.key) == before, lease.key
    assert _get(b, "report:finished").result == {"accepted": True}


# -- renew_many ------------------------------------------------------------------------------


def test_renew_many_renews_the_current_and_refuses_the_stale_in_one_batch(
    stores: list[Store], clock: ManualClock
) -> None:
    """One renew_many batch mixing current leases with an expired one, one taken over by
    another owner, a released one, a finished one and one with a wrong token: the result maps
    every key; the current ones come back with deadline now + ttl (same key, owner, token) and
    their rows show it; the stale ones are None and their rows are unchanged."""
    a, b = stores
    live = [a.claim(f"report:live:{i}", owner="worker-a", ttl=TTL) for i in range(3)]
    expired = a.claim("report:expired", owner="worker-a", ttl=5)
    taken = a.claim("report:taken", owner="worker-a", ttl=5)
    released = a.claim("report:released", owner="worker-a", ttl=TTL)
    finished = a.claim("report:finished", owner="worker-a", ttl=TTL)
    wrong = a.claim("report:wrong-token", owner="worker-a", ttl=TTL)
    assert all(live) and expired and taken and released and finished and wrong
    assert a.release(released) is True
    assert a.finish(finished, "done") is True
    clock.now = 106.0
    assert b.claim("report:taken", owner="worker-b", ttl=TTL) is not None
    stale = [expired, taken, released, finished, dataclasses.replace(wrong, token=7)]
    before = {lease.key: _get(a, lease.key) for lease in stale}

    batch = [live[0], stale[0], live[1], *stale[1:], live[2]]
    result = dict(zip(map(id, batch), a.renew_many(batch, ttl=20), strict=True))

    for lease in live:
        assert result[id(lease)] == dataclasses.replace(lease, expires_at=126.0)
        assert _get(b, lease.key).expires_at == 126.0
    for lease in stale:
        assert result[id(lease)] is None, lease.key
        assert _get(b, lease.key) == before[lease.key], lease.key
    assert _get(b, "report:wrong-token").expires_at == 110.0
    assert a.renew_many([], ttl=TTL) == []


def test_renew_many_tells_two_generations_of_one_key_apart(
        stores: list[Store], clock: ManualClock) -> None:
    """An old generation (released) and the new one of the same key, in one batch, as two
    executions in one process could hold them: each gets its own answer, in order, and the
    renewed lease keeps its attempts and takeovers."""
    a, _ = stores
    old = a.claim("report:twice", owner="same-process", ttl=TTL)
    assert old is not None and a.release(old)
    new = a.claim("report:twice", owner="same-process", ttl=TTL)
    assert new is not None
    for batch in ([old, new], [new, old]):
        renewed = a.renew_many(batch, ttl=TTL)
        assert [r is not None for r in renewed] == [lease is new for lease in batch]
        fresh = next(r for r in renewed if r is not None)
        assert (fresh.token, fresh.attempts, fresh.takeovers) == (token_base(a) + 2, 2, 0)
