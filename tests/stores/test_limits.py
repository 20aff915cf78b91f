"""The key-group limit contract (``Store.claim_limited``, ``hand_on``, ``set_limit``,
``limits``), the same test body on every store, on an injected clock."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from lease_celery import ConfigError, Lease, LimitRefused, Store, open_store
from lease_celery.limits import GroupLimit, parse_rate
from lease_celery.testing import ManualClock

TTL = 10.0


def info(key: str) -> dict[str, Any]:
    return {"task": "t.limited", "args": [key], "kwargs": {}, "options": {"task_id": key}}


def claim(store: Store, key: str, limit: GroupLimit, *, task: bool = True,
          owner: str = "w1") -> Lease | LimitRefused | None:
    return store.claim_limited(key, owner=owner, ttl=TTL, limit=limit,
                               task=info(key) if task else None)


def test_at_most_n_run_and_the_rest_wait_in_arrival_order(stores: list[Store],
                                                          clock: ManualClock) -> None:
    """Two slots: the first two claims are granted with growing slot tokens; the next wait,
    parked (once each, a duplicate included); a finish frees a slot, and hand-on gives it to
    the first waiter, whose claim is then granted while a newcomer keeps waiting."""
    a, b = stores
    group = GroupLimit("tenant:1", limit=2)
    first, second = claim(a, "k1", group), claim(b, "k2", group)
    assert isinstance(first, Lease) and isinstance(second, Lease)
    assert (first.group, second.group) == ("tenant:1", "tenant:1")
    assert first.slot is not None and second.slot == first.slot + 1
    refused = claim(a, "k3", group)
    assert isinstance(refused, LimitRefused) and refused.parked
    assert (refused.reason, refused.running, refused.limit, refused.waiting) == (
        "limit", 2, 2, 1)
    assert isinstance(claim(b, "k4", group), LimitRefused)
    again = claim(b, "k3", group)  # a duplicate of a waiting key: still one waiter
    assert isinstance(again, LimitRefused) and again.waiting == 2
    assert a.hand_on("tenant:1") == []  # full: nobody to hand on
    assert a.finish(first, "ok")
    handed = a.hand_on("tenant:1")
    assert [(w.key, w.group, w.task) for w in handed] == [("k3", "tenant:1", info("k3"))]
    assert a.hand_on("tenant:1") == []  # handed on already, within the grace
    assert isinstance(claim(b, "k5", group), LimitRefused)  # a newcomer does not overtake
    assert isinstance(claim(b, "k4", group), LimitRefused)  # nor does the second waiter
    third = claim(b, "k3", group)
    assert isinstance(third, Lease) and third.slot == second.slot + 1
    listed = a.limit_group("tenant:1")
    assert listed is not None and (listed.running, listed.waiting, listed.limit) == (2, 2, 2)


def test_a_stalled_holder_loses_its_slot_with_its_lease(stores: list[Store],
                                                        clock: ManualClock) -> None:
    """A holder past its ttl frees its slot by expiring: the sweeper's hand-on finds it free,
    the waiter's claim is granted, and the stalled holder's finish is refused."""
    a, b = stores
    group = GroupLimit("solo", limit=1)
    stalled = claim(a, "k1", group)
    assert isinstance(stalled, Lease)
    assert isinstance(claim(b, "k2", group), LimitRefused)
    clock.advance(TTL / 2)
    assert a.renew(stalled, ttl=TTL) is not None  # renewing the lease renews the slot
    clock.advance(TTL - 0.01)
    assert b.hand_on() == []  # still held
    clock.advance(0.02)
    assert [w.key for w in b.hand_on()] == ["k2"]
    successor = claim(b, "k2", group)
    assert isinstance(successor, Lease)
    assert a.finish(stalled, "late") is False
    assert isinstance(claim(a, "k3", group), LimitRefused)


def test_release_and_death_free_the_slot_and_a_held_key_drops_its_waiter(
        stores: list[Store], clock: ManualClock) -> None:
    a, b = stores
    group = GroupLimit("g", limit=1)
    holder = claim(a, "k1", group)
    assert isinstance(holder, Lease)
    assert isinstance(claim(b, "k2", group), LimitRefused)
    assert a.release(holder, reason="retry later")
    assert [w.key for w in a.hand_on("g")] == ["k2"]
    taken = claim(b, "k2", group)
    assert isinstance(taken, Lease)
    assert a.kill(taken, reason="gave up")
    # k2 is dead: its claim is refused by the key itself, and would drop a waiter entry
    assert claim(b, "k2", group) is None
    assert isinstance(claim(b, "k1", group), Lease)  # the released key, granted again


def test_a_delivery_that_cannot_be_recorded_is_not_parked(stores: list[Store],
                                                          clock: ManualClock) -> None:
    a, _ = stores
    group = GroupLimit("g", limit=1)
    assert isinstance(claim(a, "k1", group), Lease)
    refused = claim(a, "k2", group, task=False)
    assert isinstance(refused, LimitRefused) and not refused.parked
    found = a.limit_group("g")
    assert found is not None and found.waiting == 0


def test_a_rate_spaces_starts_evenly_on_the_store_clock(stores: list[Store],
                                                        clock: ManualClock) -> None:
    a, b = stores
    group = GroupLimit("api", rate=parse_rate("4/s"))
    assert isinstance(claim(a, "k1", group), Lease)
    refused = claim(b, "k2", group)
    assert isinstance(refused, LimitRefused) and not refused.parked
    assert refused.reason == "rate" and refused.retry_at == pytest.approx(clock.now + 0.25)
    clock.advance(0.24)
    assert isinstance(claim(b, "k2", group), LimitRefused)
    clock.advance(0.02)
    assert isinstance(claim(b, "k2", group), Lease)
    starts = 2
    for i in range(3, 20):  # 17 tries every 10 ms, all before the next start is due
        clock.advance(0.01)
        starts += isinstance(claim(a, f"k{i}", group), Lease)
    assert starts == 2  # 0.17s after the second start: none due yet
    clock.advance(0.1)
    assert isinstance(claim(a, "late", group), Lease)


def test_an_operators_limit_overrides_the_tasks_until_reset(stores: list[Store],
                                                           clock: ManualClock) -> None:
    a, b = stores
    group = GroupLimit("g", limit=1)
    assert isinstance(claim(a, "k1", group), Lease)
    assert isinstance(claim(a, "k2", group), LimitRefused)
    assert isinstance(claim(a, "k3", group), LimitRefused)
    raised = b.set_limit("g", concurrency=2)
    assert (raised.limit, raised.limit_set, raised.task_limit) == (2, True, 1)
    assert [w.key for w in b.hand_on("g")] == ["k2"]
    assert isinstance(claim(a, "k2", group), Lease)
    lifted = b.set_limit("g", concurrency=False)
    assert lifted.limit is None and lifted.limit_set
    assert [w.key for w in b.hand_on("g")] == ["k3"]
    assert isinstance(claim(a, "k3", group), Lease)
    rated = b.set_limit("g", rate="1/m")
    assert rated.rate == "1/m" and rated.rate_set
    assert isinstance(claim(a, "k4", group), Lease)
    assert isinstance(claim(a, "k5", group), LimitRefused)  # the operator's rate holds
    back = b.set_limit("g", reset=True)
    assert (back.limit, back.rate, back.limit_set, back.rate_set) == (1, None, False, False)
    assert [g.group for g in a.limits()] == ["g"]


def test_bad_limits_are_refused_naming_the_option(stores: list[Store]) -> None:
    a, _ = stores
    with pytest.raises(ConfigError, match="a limit or a rate"):
        GroupLimit("g")
    with pytest.raises(ConfigError, match="limit must be a whole number"):
        a.set_limit("g", concurrency=0)
    with pytest.raises(ConfigError, match="rate must be a rate"):
        a.set_limit("g", rate="ten")
    with pytest.raises(ConfigError, match="give a limit, a rate, or reset"):
        a.set_limit("g")
    assert a.limit_group("g") is None  # nothing was written


def test_concurrent_claims_never_grant_more_than_the_limit(stores: list[Store],
                                                           clock: ManualClock) -> None:
    """Sixteen claims of one group at once, from two store objects: three granted."""
    group = GroupLimit("race", limit=3)
    granted: list[object] = []
    gate = threading.Barrier(16)

    def racer(n: int) -> None:
        gate.wait()
        granted.append(claim(stores[n % 2], f"r{n}", group, owner=f"w{n}"))

    threads = [threading.Thread(target=racer, args=(n,)) for n in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sum(isinstance(g, Lease) for g in granted) == 3
    found = stores[0].limit_group("race")
    assert found is not None and (found.running, found.waiting) == (3, 13)


def test_redis_a_limited_claim_whose_reply_was_lost_reports_its_slot(
        redis_store_url: str) -> None:
    """The limited claim's script ran (the slot granted) but its reply was lost: the re-sent
    copy is refused, and the lease the first copy granted is recognised by its nonce, with
    the slot token the row records (it came back without one). Found by the reference model
    (tests/stores/test_model.py)."""
    import redis as redis_py

    with open_store(redis_store_url) as store:
        caller = store._caller  # type: ignore[attr-defined]
        real, lost = caller.run, []

        def losing(script: object, keys: object, args: object, **kw: object) -> object:
            answer = real(script, keys, args, **kw)
            if not lost:
                lost.append(answer)
                raise redis_py.ConnectionError("test: the reply was lost")
            return answer

        store.now()  # the epoch opened before the reply is lost
        caller.run = losing
        lease = store.claim_limited("slot:lost", owner="w", ttl=10,
                                    limit=GroupLimit("slots", 1))
        assert lost, "the limited claim was not sent"
        assert isinstance(lease, Lease) and (lease.group, lease.slot) == ("slots", 1)
