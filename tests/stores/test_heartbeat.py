"""The heartbeat: one thread per process renewing held leases, and reporting losses honestly."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from lease_celery import LeaseLost, open_store, signals
from lease_celery.errors import StoreError
from lease_celery.runtime.execution import Execution, Phase
from lease_celery.runtime.heartbeat import Heartbeat
from lease_celery.stores.base import Store
from tests.support.proxy import cuttable_proxy


def _watched(store: Store, key: str, *, ttl: float, interval: float) -> Execution:
    sent_at = time.monotonic()
    lease = store.claim(key, owner="heartbeat-test", ttl=ttl)
    assert lease is not None
    handle = Execution(lease, store=store, ttl=ttl, heartbeat_interval=interval,
                         sent_at=sent_at)
    Heartbeat.for_process().watch(handle)
    return handle


class LostSignals:
    def __init__(self) -> None:
        self.reasons: list[str] = []
        self.event = threading.Event()

    def __call__(self, sender: Any = None, reason: str = "", **_: Any) -> None:
        self.reasons.append(reason)
        self.event.set()


@pytest.fixture
def lost_signals() -> Any:
    receiver = LostSignals()
    signals.lease_lost.connect(receiver, weak=False)
    yield receiver
    signals.lease_lost.disconnect(receiver)


def test_heartbeat_keeps_a_lease_alive_well_past_its_ttl(store_url: str) -> None:
    """With ttl 0.6 s and renewals every 0.15 s, the lease is still held (and its store-side
    deadline keeps moving) after 2.5 s; no other owner can claim it meanwhile."""
    with open_store(store_url) as store:
        handle = _watched(store, "hb:alive", ttl=0.6, interval=0.15)
        first_deadline = handle.lease.expires_at
        try:
            time.sleep(2.5)
            handle.view.check()
            assert handle.lease.expires_at > first_deadline + 1.5
            assert store.claim("hb:alive", owner="other", ttl=1) is None
            assert store.finish(handle.lease, "ok")
        finally:
            Heartbeat.for_process().unwatch(handle)


def test_a_failure_in_the_scheduling_thread_does_not_stop_the_renewals(
        sqlite_url: str, caplog: pytest.LogCaptureFixture) -> None:
    """The scheduling thread meets an exception (a bug of ours, as an early version of the
    carried finish's wake-up had): it logs it and goes on, and the lease it renews is still
    held 2 s later with a ttl of 0.6 s. Before, the thread ended, and every renewal with it."""
    heartbeat = Heartbeat()  # its own: the failure stays in this test
    real, failures = heartbeat._due, [RuntimeError("test: the scheduling failed")]

    def failing_once() -> Any:
        if failures:
            raise failures.pop()
        return real()

    heartbeat._due = failing_once  # type: ignore[method-assign]  # from its next round on
    with open_store(sqlite_url) as store:
        lease = store.claim("hb:guarded", owner="heartbeat-test", ttl=0.6)
        assert lease is not None
        handle = Execution(lease, store=store, ttl=0.6, heartbeat_interval=0.15,
                             sent_at=time.monotonic())
        with caplog.at_level("ERROR", logger="lease_celery.runtime.heartbeat"):
            heartbeat.watch(handle)
            time.sleep(2.0)
        try:
            assert failures == [], "the failure was not met"
            assert "scheduling failed" in caplog.text
            assert store.claim("hb:guarded", owner="other", ttl=1) is None  # still held
            handle.view.check()
        finally:
            heartbeat.unwatch(handle)


def test_refused_renewal_marks_the_lease_lost_and_signals(
        store_url: str, lost_signals: LostSignals) -> None:
    """Once the store refuses a renewal (the key was taken over), the handle is lost at once:
    ``check()`` raises LeaseLost and lease_lost fires with the reason."""
    t = [1_000.0]
    with open_store(store_url, clock=lambda: t[0]) as store:
        handle = _watched(store, "hb:refused", ttl=30, interval=0.1)
        t[0] += 30  # the lease expires on the store's (injected) clock …
        assert store.claim("hb:refused", owner="usurper", ttl=30) is not None  # … and is taken
        assert lost_signals.event.wait(5)
        assert "refused" in lost_signals.reasons[0]
        with pytest.raises(LeaseLost, match="renewal refused"):
            handle.view.check()


def test_unreachable_postgres_reports_the_lease_lost_by_its_deadline(
        postgres_url: str, lost_signals: LostSignals) -> None:
    """The PostgreSQL server goes out of reach (every connection dropped, new ones refused):
    the heartbeat cannot renew, so by the lease's deadline ``check()`` raises and lease_lost
    fires. It never assumes it still holds the lease."""
    query = postgres_url.partition("?")[2]
    with cuttable_proxy("127.0.0.1", 5432) as proxy:
        url = f"postgresql://127.0.0.1:{proxy.port}/test?{query}&reconnect_timeout=0.5"
        with open_store(url) as store:
            handle = _watched(store, "hb:unreachable", ttl=1.5, interval=0.3)
            time.sleep(0.5)
            handle.view.check()  # renewed at least once through the proxy
            proxy.cut()
            cut_at = time.monotonic()
            assert lost_signals.event.wait(10), "lease_lost was never sent"
            with pytest.raises(LeaseLost, match=r"no renewal succeeded|unreachable"):
                handle.view.check()
            # Lost no later than a few retries after the deadline it could have held to.
            assert time.monotonic() - cut_at < 1.5 + 3
    assert "unreachable" in lost_signals.reasons[0]


class CountingStore:
    """A real store whose ``renew_many`` calls are counted (round trips per interval)."""

    def __init__(self, store: Store) -> None:
        self.store, self.calls, self.renewed = store, 0, 0

    def renew_many(self, leases: Any, *, ttl: float) -> Any:
        self.calls += 1
        self.renewed += len(leases)
        return self.store.renew_many(leases, ttl=ttl)


def test_staggered_leases_renew_in_one_batch_per_interval(sqlite_url: str) -> None:
    """1,000 leases claimed one after another across a whole interval (a threads-pool worker's
    start times) are renewed in at most two store round trips per interval once the first
    interval passed, not one each; every lease stays held."""
    interval, ttl, count = 0.4, 1.6, 1000
    with open_store(sqlite_url) as store:
        counting = CountingStore(store)
        handles = []
        start = time.monotonic()
        for n in range(count):
            lease = store.claim(f"hb:many:{n}", owner="heartbeat-test", ttl=ttl)
            assert lease is not None
            handle = Execution(lease, store=counting,  # type: ignore[arg-type]
                                 ttl=ttl, heartbeat_interval=interval,
                                 sent_at=time.monotonic())
            handles.append(handle)
            Heartbeat.for_process().watch(handle)
            time.sleep(max(0.0, start + interval * (n + 1) / count - time.monotonic()))
        try:
            time.sleep(interval * 1.5)  # the batches converge
            calls, renewed = counting.calls, counting.renewed
            time.sleep(interval * 5)
            assert counting.calls - calls <= 2 * 5 + 1, (
                f"{counting.calls - calls} round trips in 5 intervals")
            assert counting.renewed - renewed >= count * 4  # every lease, every interval
            for handle in handles:
                handle.view.check()
        finally:
            for handle in handles:
                Heartbeat.for_process().unwatch(handle)


class SlowStore(CountingStore):
    """Answers every renewal ``delay`` seconds late (the store, or the network, is slow)."""

    def __init__(self, store: Store, delay: float) -> None:
        super().__init__(store)
        self.delay = delay

    def renew_many(self, leases: Any, *, ttl: float) -> Any:
        time.sleep(self.delay)
        return super().renew_many(leases, ttl=ttl)


def test_renewals_go_out_on_time_while_slow_replies_are_pending(sqlite_url: str) -> None:
    """Replies 0.6 × ttl late (more than the interval): the next renewal is sent on schedule
    while the previous one waits, so the lease, which the store keeps renewing, is never
    taken for lost here. (Sent one at a time, the second renewal would only leave when the
    first reply came back, and the deadline would pass before its reply.)"""
    ttl, interval = 1.0, 0.25
    with open_store(sqlite_url) as store:
        slow = SlowStore(store, delay=0.6 * ttl)
        lease = store.claim("hb:slow", owner="heartbeat-test", ttl=ttl)
        assert lease is not None
        handle = Execution(lease, store=slow,  # type: ignore[arg-type]
                             ttl=ttl, heartbeat_interval=interval, sent_at=time.monotonic())
        Heartbeat.for_process().watch(handle)
        try:
            deadline = time.monotonic() + 4 * ttl
            while time.monotonic() < deadline:
                handle.view.check()
                time.sleep(0.02)
            assert slow.calls >= 12
        finally:
            Heartbeat.for_process().unwatch(handle)


class SlowSettles(CountingStore):
    """Renews at once, but takes ``delay`` seconds to answer a settle confirmation."""

    def __init__(self, store: Store, delay: float) -> None:
        super().__init__(store)
        self.delay, self.settled = delay, 0

    def settle_many(self, leases: Any) -> Any:
        time.sleep(self.delay)
        self.settled += len(leases)
        return self.store.settle_many(leases)


def test_a_slow_settle_confirmation_does_not_hold_renewals_back(sqlite_url: str) -> None:
    """A settle confirmation that takes twice the ttl to answer (a slow store) is sent while
    the other leases keep renewing on schedule: none of them is lost meanwhile."""
    ttl, interval = 1.0, 0.25
    with open_store(sqlite_url) as store:
        slow = SlowSettles(store, delay=2 * ttl)
        finished = store.claim("hb:settling", owner="heartbeat-test", ttl=ttl)
        running = store.claim("hb:running", owner="heartbeat-test", ttl=ttl)
        assert finished is not None and running is not None
        assert store.finish(finished, 1, settle_within=10)
        done = Execution(finished, store=slow,  # type: ignore[arg-type]
                           ttl=ttl, heartbeat_interval=interval, sent_at=time.monotonic())
        held = Execution(running, store=slow,  # type: ignore[arg-type]
                           ttl=ttl, heartbeat_interval=interval, sent_at=time.monotonic())
        heartbeat = Heartbeat.for_process()
        heartbeat.watch(held)
        heartbeat.settle(done)
        try:
            deadline = time.monotonic() + 3 * ttl
            while time.monotonic() < deadline:
                held.view.check()
                time.sleep(0.02)
            assert slow.settled == 1
            assert store.get("hb:settling").settling is False  # type: ignore[union-attr]
        finally:
            heartbeat.unwatch(held)


class UnreachableUntil(CountingStore):
    """Every renewal and settle confirmation fails until ``until`` (monotonic), as when the
    store's connections are cut, then the store answers again."""

    def __init__(self, store: Store, until: float) -> None:
        super().__init__(store)
        self.until, self.settle_attempts = until, 0

    def _reachable(self) -> None:
        if time.monotonic() < self.until:
            raise StoreError("the lease store is unreachable (test)")

    def renew_many(self, leases: Any, *, ttl: float) -> Any:
        self._reachable()
        return super().renew_many(leases, ttl=ttl)

    def settle_many(self, leases: Any) -> Any:
        self.settle_attempts += 1
        self._reachable()
        return self.store.settle_many(leases)


def _settling(store: Store, proxy: Any, key: str, *, ttl: float) -> Execution:
    """A watched lease whose finish was accepted with the task's settle deadline (one ttl)."""
    sent_at = time.monotonic()
    lease = store.claim(key, owner="heartbeat-test", ttl=ttl)
    assert lease is not None
    handle = Execution(lease, store=proxy, ttl=ttl, heartbeat_interval=ttl / 4,
                         sent_at=sent_at)
    Heartbeat.for_process().watch(handle)
    assert store.finish(lease, 1, settle_within=ttl)
    handle.enter(Phase.SETTLING)
    return handle


def test_a_settle_confirmation_failing_past_the_deadline_is_retried_until_it_lands(
        sqlite_url: str) -> None:
    """The store is out of reach for 2 × ttl right after Celery stored the outcome (the
    confirmation fails, and the handle's local deadline passes meanwhile): the confirmation is
    retried until the store answers, and the owner settles the key. Dropped once the local
    deadline had passed, the row stayed settling, its deadline passed, and a redelivery
    completed the key: Celery stored the outcome a second time while the owner was alive
    (the chaos run's double_result_write on Redis)."""
    ttl = 1.0
    with open_store(sqlite_url) as store:
        unreachable = UnreachableUntil(store, until=time.monotonic() + 2 * ttl)
        handle = _settling(store, unreachable, "hb:settle-retried", ttl=ttl)
        Heartbeat.for_process().settle(handle)
        give_up = unreachable.until + 3.0
        while store.get("hb:settle-retried").settling and time.monotonic() < give_up:  # type: ignore[union-attr]
            time.sleep(0.05)
        row = store.get("hb:settle-retried")
        assert row is not None and not row.settling, (
            f"still settling after {unreachable.settle_attempts} confirmation attempts")
        assert row.owner == "heartbeat-test"
        assert store.claim_settlement("hb:settle-retried", owner="redelivery", ttl=ttl) is None


def test_the_settle_deadline_is_renewed_while_the_confirmation_waits_for_its_reply(
        sqlite_url: str) -> None:
    """A confirmation that takes 2 × ttl to reach the store (slow replies, a busy sender):
    meanwhile the heartbeat keeps the settle deadline alive, so a redelivery cannot take the
    settlement over from the living owner (and store the outcome again). Before, the renewals
    stopped when the confirmation was queued and the deadline passed one ttl later."""
    ttl = 1.0
    with open_store(sqlite_url) as store:
        slow = SlowSettles(store, delay=2 * ttl)
        handle = _settling(store, slow, "hb:settle-slow", ttl=ttl)
        Heartbeat.for_process().settle(handle)
        taken = None
        give_up = time.monotonic() + 2 * ttl + 3.0
        while store.get("hb:settle-slow").settling and time.monotonic() < give_up:  # type: ignore[union-attr]
            taken = taken or store.claim_settlement("hb:settle-slow", owner="redelivery", ttl=ttl)
            time.sleep(0.05)
        assert taken is None, "a redelivery took the settlement over from the living owner"
        row = store.get("hb:settle-slow")
        assert row is not None and not row.settling and row.owner == "heartbeat-test"


class HangingRenewals(CountingStore):
    """The first renewal hangs ``hang`` seconds, then fails: its connection died without a
    word (a proxy or a server restart) and it waits for the socket timeout. Later calls go
    out on fresh connections and are answered."""

    def __init__(self, store: Store, hang: float) -> None:
        super().__init__(store)
        self.hang = hang

    def renew_many(self, leases: Any, *, ttl: float) -> Any:
        if self.calls == 0:
            self.calls += 1
            time.sleep(self.hang)
            raise StoreError("the lease store did not answer (test)")
        return super().renew_many(leases, ttl=ttl)


def test_renewals_go_out_on_time_while_every_sender_waits_on_a_dead_connection(
        sqlite_url: str) -> None:
    """As many calls as there are senders hang on dead connections for 3 × ttl (the chaos run:
    a settle confirmation queued behind them for 5 s, past its deadline): the heartbeat starts
    more senders, so the next renewals go out on time, on fresh connections, and no lease is
    lost."""
    from lease_celery.runtime.senders import SENDERS

    ttl, interval = 1.0, 0.25
    heartbeat = Heartbeat.for_process()
    with open_store(sqlite_url) as store:
        hanging = [HangingRenewals(store, hang=3 * ttl) for _ in range(SENDERS)]
        stuck = []
        for n, wrapper in enumerate(hanging):
            lease = store.claim(f"hb:stuck:{n}", owner="heartbeat-test", ttl=ttl)
            assert lease is not None
            stuck.append(Execution(lease, store=wrapper,  # type: ignore[arg-type]
                                     ttl=ttl, heartbeat_interval=interval,
                                     sent_at=time.monotonic()))
        for handle in stuck:
            heartbeat.watch(handle)
        time.sleep(interval * 1.5)  # every sender is now waiting on a hung call
        assert all(wrapper.calls == 1 for wrapper in hanging)
        healthy = _watched(store, "hb:healthy", ttl=ttl, interval=interval)
        try:
            deadline = time.monotonic() + 2.5 * ttl
            while time.monotonic() < deadline:
                for handle in [healthy, *stuck]:
                    handle.view.check()
                time.sleep(0.02)
        finally:
            heartbeat.unwatch(healthy)
            for handle in stuck:
                heartbeat.unwatch(handle)
