"""A fire-and-forget task's finish is written behind its return
(``lease_celery.execution.background``).

In process, through Celery's own tracer and a real SQLite store: where the write happens, what
the signals see, a non-JSON result, a refused (stale) write, and the flush a process makes
when it goes. With real workers: a warm shutdown right after such a task returned, while the
store answers slowly, leaves the key done and the body run once.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest
from celery import Celery
from celery.app.trace import build_tracer

from benchmarks.chaos.proxy import DelayingProxy
from lease_celery import LeasedTask, open_store, signals
from lease_celery.errors import ResultNotSerializable
from lease_celery.models import LeaseState
from lease_celery.runtime.execution import Execution
from lease_celery.runtime.heartbeat import Heartbeat
from lease_celery.runtime.senders import MAX_SENDERS
from lease_celery.stores.registry import shared_store
from tests.support.tokens import token_base
from tests.support.workers import WorkerPool


def _app(sqlite_url: str, **conf: Any) -> tuple[Celery, Any]:
    app = Celery(f"background-{uuid.uuid4().hex[:6]}", broker="memory://",
                 backend="disabled://", set_as_current=False)
    app.conf.update(lease_store_url=sqlite_url, task_ignore_result=True,
                    lease_sweep_interval=0, **{"lease_finish_in_background": True, **conf})

    @app.task(bind=True, base=LeasedTask, lease_key="bg:{n}", shared=False)
    def quiet(self: LeasedTask, n: int, value: Any = None, sleep: float = 0.0) -> Any:
        time.sleep(sleep)
        return value

    app.finalize()
    return app, quiet


def _trace(app: Celery, task: Any, task_id: str, *args: Any, **kwargs: Any) -> Any:
    tracer = build_tracer(task.name, task, app=app, eager=False, propagate=False)
    message = {"id": task_id, "task": task.name, "args": list(args), "kwargs": kwargs,
               "delivery_info": {"routing_key": "celery", "exchange": "", "priority": 0,
                                 "redelivered": False}, "hostname": "test"}
    return tracer(task_id, args, kwargs, message)


@pytest.fixture
def finished() -> Iterator[list[tuple[str, str | None, str]]]:
    """``lease_finished`` as (key, the request id the receiver sees, the thread it ran on)."""
    seen: list[tuple[str, str | None, str]] = []

    def on_finished(sender: Any = None, key: str = "", **_: Any) -> None:
        seen.append((key, getattr(sender.request, "id", None), threading.current_thread().name))

    signals.lease_finished.connect(on_finished, weak=False)
    yield seen
    signals.lease_finished.disconnect(on_finished)


def _short_bodies_are_carried(monkeypatch: pytest.MonkeyPatch, *, threshold: float = 60.0,
                              within: float | None = 30.0) -> None:
    """Carry the finish of any body shorter than ``threshold`` (seconds): a no-op body's
    wall time passes the 2 ms of ``BACKGROUND_AFTER`` on a loaded machine, and its finish
    then goes to a sender instead (a test of the carried finish failed so under the full
    suite); and (``within``) no sender takes a carried finish meanwhile."""
    from lease_celery import settings
    from lease_celery.execution import background

    monkeypatch.setattr(settings, "BACKGROUND_AFTER", threshold)
    if within is not None:
        monkeypatch.setattr(background, "CARRY_WITHIN", within)


def _wait_done(url: str, key: str, timeout: float = 5.0) -> Any:
    with open_store(url) as store:
        deadline = time.monotonic() + timeout
        while True:
            record = store.get(key)
            if (record is not None and record.state is LeaseState.DONE) or \
                    time.monotonic() > deadline:
                return record
            time.sleep(0.01)


def test_the_finish_of_a_fire_and_forget_task_is_written_on_a_sender_thread(
        sqlite_url: str, finished: list[tuple[str, str | None, str]]) -> None:
    """Nothing stored, nothing sent on: the tracer returns, and a heartbeat sender writes the
    finish; ``lease_finished`` fires there with the delivery's request, so receivers read
    ``sender.request.id`` as in the task. ``lease_finish_in_background=False`` writes it in
    the task, before the tracer returns."""
    app, quiet = _app(sqlite_url)
    assert _trace(app, quiet, "t-bg", 1, value={"n": 1}).retval == {"n": 1}
    record = _wait_done(sqlite_url, "bg:1")
    assert record is not None and record.state is LeaseState.DONE and not record.settling
    assert record.result == {"n": 1} and record.token == 1
    deadline = time.monotonic() + 5
    while not finished and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(finished) == 1
    key, request_id, thread = finished[0]
    assert (key, request_id) == ("bg:1", "t-bg") and thread.startswith("lease-send-")

    app, inline = _app(sqlite_url, lease_finish_in_background=False)
    _trace(app, inline, "t-inline", 2)
    assert finished[1] == ("bg:2", "t-inline", threading.current_thread().name)


def test_by_default_a_short_body_s_finish_is_carried_and_a_longer_one_s_sent_behind(
        sqlite_url: str, finished: list[tuple[str, str | None, str]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``lease_finish_in_background`` unset ("auto"): a no-op body's finish waits for the next
    claim, which carries it (the round trip saved, no sender woken); a longer body's goes to
    a sender thread at once (off the next task's path; 60 ms against a threshold of 50 here).
    A carried finish that no claim takes in time is written by a sender. A value other than
    True, False or "auto" is refused, naming the setting."""
    from lease_celery.execution import background

    _short_bodies_are_carried(monkeypatch, threshold=0.05)
    app = Celery(f"background-{uuid.uuid4().hex[:6]}", broker="memory://",
                 backend="disabled://", set_as_current=False)
    app.conf.update(lease_store_url=sqlite_url, task_ignore_result=True,
                    lease_sweep_interval=0)

    @app.task(bind=True, base=LeasedTask, lease_key="auto:{n}", shared=False)
    def job(self: LeasedTask, n: int, sleep: float) -> int:
        time.sleep(sleep)
        return n

    app.finalize()
    _trace(app, job, "t-quick", 1, 0.0)
    assert finished == []  # not in the task: queued for the next claim
    record = shared_store(sqlite_url).get("auto:1")
    assert record is not None and record.state is LeaseState.RUNNING
    _trace(app, job, "t-slow", 2, 0.06)
    assert finished[0] == ("auto:1", "t-quick", threading.current_thread().name)
    assert _wait_done(sqlite_url, "auto:2").state is LeaseState.DONE
    deadline = time.monotonic() + 5
    while len(finished) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert finished[1][:2] == ("auto:2", "t-slow") and finished[1][2].startswith("lease-send-")

    monkeypatch.setattr(background, "CARRY_WITHIN", 0.05)
    _trace(app, job, "t-alone", 3, 0.0)
    record = _wait_done(sqlite_url, "auto:3")
    assert record is not None and record.state is LeaseState.DONE
    deadline = time.monotonic() + 5
    while len(finished) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert finished[2][:2] == ("auto:3", "t-alone") and finished[2][2].startswith("lease-send-")

    app.conf.lease_finish_in_background = "sometimes"
    from lease_celery.errors import ConfigError
    from lease_celery.settings import resolve_settings
    with pytest.raises(ConfigError, match=r"lease_finish_in_background .*'sometimes'"):
        resolve_settings(app, job)


def test_a_result_the_store_cannot_hold_fails_the_task_before_anything_is_queued(
        sqlite_url: str, finished: list[tuple[str, str | None, str]]) -> None:
    """A non-JSON result fails the task in the task (as a synchronous finish would), and no
    finish is written for it, now or later."""
    app, quiet = _app(sqlite_url)
    traced = _trace(app, quiet, "t-set", 3, value={1, 2})
    assert isinstance(traced.retval.exception, ResultNotSerializable)
    Heartbeat.for_process().writes.flush(2.0)
    with open_store(sqlite_url) as store:
        record = store.get("bg:3")
    assert record is not None and record.state is not LeaseState.DONE
    assert finished == []


def test_a_background_finish_the_store_refuses_is_reported_stale(sqlite_url: str) -> None:
    """The lease is taken over between the task's return and the write: the store refuses it,
    ``stale_result_rejected`` fires (with the request), and the new owner's lease stands."""
    app, quiet = _app(sqlite_url)
    store = shared_store(sqlite_url)
    refused: list[tuple[str, str | None]] = []

    def on_stale(sender: Any = None, key: str = "", **_: Any) -> None:
        refused.append((key, getattr(sender.request, "id", None)))

    real_finish = store.finish
    takeover: list[Any] = []

    def finish_after_a_takeover(lease: Any, result: Any = None, **kw: Any) -> bool:
        # What a stall past the ttl looks like to the store: the row changed hands.
        assert store.force_release(lease.key, reason="test: taken over")
        takeover.append(store.claim(lease.key, owner="other-owner", ttl=30))
        return real_finish(lease, result, **kw)

    signals.stale_result_rejected.connect(on_stale, weak=False)
    store.finish = finish_after_a_takeover  # type: ignore[method-assign]
    try:
        _trace(app, quiet, "t-stale", 4, value="late")
        Heartbeat.for_process().writes.flush(5.0)
        deadline = time.monotonic() + 5
        while not refused and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        del store.finish
        signals.stale_result_rejected.disconnect(on_stale)
    assert refused == [("bg:4", "t-stale")]
    record = store.get("bg:4")
    assert record is not None and record.state is LeaseState.RUNNING
    assert (record.owner, record.token) == ("other-owner", takeover[0].token)


def test_the_next_claim_carries_a_finish_behind_the_return(
        sqlite_url: str, finished: list[tuple[str, str | None, str]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Two fire-and-forget no-op deliveries back to back: the second's claim writes the
    first's finish in its own transaction (``Store.finish_and_claim``), so no sender thread
    makes it: ``lease_finished`` for the first fires on the task's own thread, with the first
    delivery's request; the first row is done with its result, the second claimed after it."""

    _short_bodies_are_carried(monkeypatch)
    app, quiet = _app(sqlite_url, lease_finish_in_background="auto")
    store = shared_store(sqlite_url)
    carried: list[tuple[str, str]] = []
    real = store.finish_and_claim

    def spy(finished_lease: Any, result: Any, key: str, **kw: Any) -> Any:
        carried.append((finished_lease.key, key))
        return real(finished_lease, result, key, **kw)

    store.finish_and_claim = spy  # type: ignore[method-assign]
    try:
        _trace(app, quiet, "t-first", 11, value="one")
        _trace(app, quiet, "t-second", 12, value="two")
    finally:
        del store.finish_and_claim
    assert carried == [("bg:11", "bg:12")]
    first = store.get("bg:11")
    assert first is not None and (first.state, first.result) == (LeaseState.DONE, "one")
    assert finished[0] == ("bg:11", "t-first", threading.current_thread().name)
    Heartbeat.for_process().writes.flush(5.0)  # nothing comes after the second
    second = store.get("bg:12")
    assert second is not None and (second.state, second.result) == (LeaseState.DONE, "two")


def test_a_carried_finish_the_store_fails_is_written_by_a_sender(
        sqlite_url: str, finished: list[tuple[str, str | None, str]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The claim that carries a finish meets a store error: the finish goes back to the
    heartbeat and a sender writes it alone (the first key ends done); the delivery's own claim
    is tried again without it and runs."""
    from lease_celery.errors import StoreError

    _short_bodies_are_carried(monkeypatch)
    app, quiet = _app(sqlite_url, lease_finish_in_background="auto")
    store = shared_store(sqlite_url)
    failures = [StoreError("test: the store failed the carrying claim")]

    def failing(*args: Any, **kw: Any) -> Any:
        raise failures.pop()

    store.finish_and_claim = failing  # type: ignore[method-assign]
    try:
        _trace(app, quiet, "t-first", 21, value="one")
        assert _trace(app, quiet, "t-second", 22, value="two").retval == "two"
    finally:
        del store.finish_and_claim
    assert failures == []  # the carrying claim was tried, and failed
    Heartbeat.for_process().writes.flush(5.0)  # nothing comes after the second
    first = _wait_done(sqlite_url, "bg:21")
    assert first is not None and (first.state, first.result) == (LeaseState.DONE, "one")
    assert _wait_done(sqlite_url, "bg:22") is not None
    deadline = time.monotonic() + 5
    while len(finished) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    by_key = {key: thread for key, _, thread in finished}
    assert by_key["bg:21"].startswith("lease-send-"), finished


def _counting_heartbeat(monkeypatch: pytest.MonkeyPatch) -> tuple[Heartbeat, list[bool]]:
    """This process's heartbeat, made anew so that every wake-up of its scheduling thread is
    recorded (True: notified, False: its own timeout)."""
    from lease_celery.runtime import heartbeat as heartbeat_module

    woken: list[bool] = []

    class Counting(threading.Condition):
        def wait(self, timeout: float | None = None) -> bool:
            notified = super().wait(timeout)
            if threading.current_thread().name == "lease-heartbeat":
                woken.append(notified)
            return notified

    with monkeypatch.context() as patch:
        patch.setattr(heartbeat_module.threading, "Condition", Counting)
        heartbeat = Heartbeat()
    monkeypatch.setattr(Heartbeat, "_instance", heartbeat)
    time.sleep(0.1)  # its first sleep
    woken.clear()
    return heartbeat, woken


def test_carried_finishes_do_not_wake_the_scheduling_thread_for_each_task(
        sqlite_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A busy process whose every finish the next claim carries: the heartbeat's scheduling
    thread is woken once (for the first finish, to look again when its carry deadline comes),
    not for each one (every wake-up costs the process CPU; it was woken twice per task)."""
    heartbeat, woken = _counting_heartbeat(monkeypatch)
    _short_bodies_are_carried(monkeypatch)  # a carry deadline of 30 s: none falls due here
    app, quiet = _app(sqlite_url, lease_finish_in_background="auto")
    for n in range(60):
        _trace(app, quiet, f"t-{n}", 1000 + n)
    time.sleep(0.1)
    assert len(woken) <= 2, f"woken {len(woken)} times for 60 carried finishes"
    heartbeat.writes.flush(5.0)  # the last one, which no claim carries
    record = shared_store(sqlite_url).get("bg:1059")
    assert record is not None and record.state is LeaseState.DONE


def test_an_occasional_carried_finish_costs_the_scheduling_thread_two_wake_ups(
        sqlite_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A process that carries a finish now and then (every 100 ms here, each carried by the
    next claim): the scheduling thread wakes for each at most twice, when it is queued and
    when its carry deadline comes, and not on a timer in between (a 20 ms timer after each
    cost about 50 wake-ups a second); one that no claim takes is written soon after its
    deadline all the same."""
    _, woken = _counting_heartbeat(monkeypatch)
    _short_bodies_are_carried(monkeypatch, within=None)  # the default deadline, 20 ms
    app, quiet = _app(sqlite_url, lease_finish_in_background="auto")
    for n in range(6):
        _trace(app, quiet, f"t-{n}", 2000 + n)
        time.sleep(0.1)
    print("WOKEN", woken)
    assert len(woken) <= 2 * 6 + 1, f"woken {len(woken)} times for 6 carried finishes"
    record = _wait_done(sqlite_url, "bg:2005", timeout=1.0)  # no claim came after it
    assert record is not None and record.state is LeaseState.DONE


class _Lease:
    key, owner, token, cancel = "flush:1", "me", 1, None


def test_a_going_process_makes_the_queued_writes_itself_and_each_happens_once() -> None:
    """Every sender busy (a slow store): a queued write is made by ``writes.flush`` in the
    calling thread; when the senders come free they do not make it again."""
    heartbeat = Heartbeat()
    gate = threading.Event()
    for _ in range(MAX_SENDERS):
        heartbeat.senders.put(gate.wait)  # each sender (as many as may start) blocks on one
    time.sleep(0.1)
    handle = Execution(_Lease(), store=None, ttl=30, heartbeat_interval=10,  # type: ignore
                         sent_at=time.monotonic())
    made: list[str] = []
    heartbeat.writes.queue(handle, lambda: made.append(threading.current_thread().name))
    time.sleep(0.1)
    assert made == []  # precondition: no sender could take it
    heartbeat.writes.flush(1.0)
    assert made == [threading.current_thread().name]
    gate.set()
    time.sleep(0.2)
    assert made == [threading.current_thread().name]


# -- real workers -----------------------------------------------------------------------------


def _through(proxy: DelayingProxy, url: str) -> str:
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, f"127.0.0.1:{proxy.port}", parts.path, parts.query, ""))


@pytest.mark.parametrize("worker_store", ["redis"], indirect=True)
@pytest.mark.worker_env(LEASE_TEST_TTL="3", LEASE_TEST_HEARTBEAT="1")
def test_a_warm_shutdown_right_after_a_fire_and_forget_task_keeps_its_finish(
        workers: WorkerPool) -> None:
    """The store answers 0.4 s late, and the worker is told to stop as soon as the body ran:
    the finish still lands (the going process waits for it, and does not release that
    lease), so the key is done with its first token and nothing runs the body again, even with a new
    worker sweeping past the ttl."""
    with open_store(workers.store_url) as store:
        # The schema exists, and the server has the claim and finish scripts, before the proxy
        # slows anything down: a script the server lacks costs two more slow round trips
        # (NOSCRIPT, SCRIPT LOAD), and the going worker waits 1 s for the write.
        warm = store.claim(f"warm-up:{uuid.uuid4().hex}", owner="warm-up", ttl=5)
        assert warm is not None and store.finish(warm, None)
    parts = urlsplit(workers.store_url)
    proxy = DelayingProxy(parts.hostname or "127.0.0.1", parts.port or 0)
    try:
        workers.env["LEASE_TEST_STORE"] = _through(proxy, workers.store_url)
        worker = workers.start("a", concurrency=1)
        # A first task while the store is fast: the pool process has its connections (a new
        # one costs five slow round trips, more than the 1 s a going process waits for the
        # write) before the proxy slows the replies down.
        warm_job = uuid.uuid4().hex[:10]
        workers.client.send_task("tests.support.worker_app.quiet", args=(warm_job,))
        warmed = _wait_done(workers.store_url, f"job:{warm_job}", timeout=20)
        assert warmed is not None and warmed.state is LeaseState.DONE, warmed
        job = uuid.uuid4().hex[:10]
        proxy.delay = 0.4
        workers.client.send_task("tests.support.worker_app.quiet", args=(job,))
        workers.journal.wait_for(lambda j: bool(j.events("body_start", job_id=job)),
                                 timeout=20, what="the body to run")
        worker.stop()
        proxy.delay = 0.0
        with open_store(workers.store_url) as store:
            record = store.get(f"job:{job}")
            base = token_base(store)
        assert record is not None and record.state is LeaseState.DONE, record
        assert record.token == base + 1
        workers.start("b", concurrency=1)
        time.sleep(3 + 3)  # past the ttl and a sweep: a key left running would run again
        assert len(workers.journal.events("body_start", job_id=job)) == 1
    finally:
        workers.stop_all()
        proxy.close()
