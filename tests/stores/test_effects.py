"""Effect receipts (``store.effects``): an outside action runs at most once per business key.

Every test runs on SQLite, PostgreSQL and Redis (``store_url``). The store-level tests share an
injected logical clock between two store objects (two workers), so lease expiry happens at
exact instants; the concurrency test uses the real clock in separate processes.

The seed's "lost response" case appears here as the crash between ``fn`` succeeding and the
receipt being marked done, simulated with the ``effect_insert`` primitive under one lease that
then expires; tests/workers/test_worker_effects.py shows the same with real worker processes.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from lease_celery import (
    EffectConflict,
    EffectOutcomeUnknown,
    EffectState,
    Lease,
    LeaseError,
    LeaseHeld,
    LeaseLost,
    LeaseState,
    PayloadNotSerializable,
    Receipt,
    Store,
    fingerprint,
    open_store,
)
from lease_celery.runtime.execution import Execution
from lease_celery.testing import ManualClock
from tests.support.tokens import token_base

TTL = 10.0
KEY = "publish:report:42:v1"
PAYLOAD = {"report_id": 42, "version": 1, "to": ["ops@example.com"], "title": "Q3 — été"}




class Target:
    """The outside resource, in process: records every call ``fn`` makes, keyed by the
    idempotency key it was given, and answers with a receipt id."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def fn(self, payload: Any = None) -> Callable[[str], dict[str, Any]]:
        def send(idempotency_key: str) -> dict[str, Any]:
            self.calls.append((idempotency_key, payload))
            return {"receipt_id": f"r-{len(self.calls)}", "key": idempotency_key}

        return send

    def keys(self) -> list[str]:
        return [key for key, _ in self.calls]


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(1_000.0)


@pytest.fixture
def target() -> Target:
    return Target()


def _receipt(store: Store, key: str = KEY) -> Receipt:
    receipt = store.effects.get(key)
    assert receipt is not None, f"no receipt for {key!r}"
    return receipt


def _claim(store: Store, key: str, owner: str) -> Lease:
    lease = store.claim(key, owner=owner, ttl=TTL)
    assert lease is not None, f"{owner} could not claim {key!r}"
    return lease


def _crashed_attempt(stores: list[Store], clock: ManualClock) -> tuple[Lease, Lease]:
    """Worker D claims ``job:42`` and starts the effect (an in-flight receipt under its lease):
    its ``fn`` succeeded at the target but D died before marking the receipt done. D's lease
    expires and worker E takes the job over. Returns (D's lease, E's lease)."""
    d, e = stores
    lease_d = _claim(d, "job:42", "worker-d")
    assert d.effect_insert(KEY, fingerprint(PAYLOAD), lease_d) is True
    clock.now += TTL  # the deadline instant: D's lease is expired
    lease_e = _claim(e, "job:42", "worker-e")
    assert lease_e.token == lease_d.token + 1
    return lease_d, lease_e


# -- performing and replaying -------------------------------------------------------------


def test_first_call_performs_and_a_replay_returns_the_recorded_result(
        stores: list[Store], target: Target) -> None:
    """The first ``once`` calls ``fn`` with the business key and records the result (receipt
    done, one attempt, the lease that performed it). A replay by another worker, another
    lease, returns that recorded result without calling ``fn``; a payload whose dict keys come
    in another order is the same payload (canonical fingerprint)."""
    d, e = stores
    lease_d = _claim(d, "job:42", "worker-d")
    first = d.effects.once(KEY, PAYLOAD, target.fn(PAYLOAD), lease=lease_d)
    assert first == {"receipt_id": "r-1", "key": KEY}
    assert target.keys() == [KEY]
    receipt = _receipt(e)
    assert (receipt.state, receipt.attempts, receipt.result) == (EffectState.DONE, 1, first)
    assert (receipt.lease_key, receipt.lease_token, receipt.lease_owner) == (
        "job:42", lease_d.token, "worker-d")
    assert receipt.fingerprint == fingerprint(PAYLOAD)

    lease_e = _claim(e, "job:other", "worker-e")
    reordered = dict(reversed(list(PAYLOAD.items())))
    assert e.effects.once(KEY, reordered, target.fn(reordered), lease=lease_e) == first
    assert e.effects.once(KEY, PAYLOAD, target.fn(PAYLOAD)) == first  # without a lease too
    assert target.keys() == [KEY]
    assert _receipt(d) == receipt  # a replay writes nothing


def test_a_none_result_is_recorded_and_replayed(stores: list[Store]) -> None:
    """``fn`` returning None is an outcome like any other: recorded done, replayed as None,
    ``fn`` not called again."""
    d, _ = stores
    calls: list[str] = []
    assert d.effects.once(KEY, PAYLOAD, calls.append) is None
    assert d.effects.once(KEY, PAYLOAD, calls.append) is None
    assert calls == [KEY]
    assert _receipt(d).state is EffectState.DONE


def test_same_key_with_another_payload_is_a_conflict(
        stores: list[Store], target: Target, clock: ManualClock) -> None:
    """The same key with a different payload raises EffectConflict without calling ``fn`` and
    without touching the receipt: whether the first attempt is done, live in flight, or
    awaiting reconciliation (the conflict is checked before anything else)."""
    d, e = stores
    d.effects.once(KEY, PAYLOAD, target.fn(PAYLOAD))
    before = _receipt(d)
    other = {**PAYLOAD, "version": 2}
    with pytest.raises(EffectConflict, match="another payload"):
        e.effects.once(KEY, other, target.fn(other))
    with pytest.raises(EffectConflict):
        e.effects.once(KEY, {**PAYLOAD, "report_id": 42.0}, target.fn())  # 42 and 42.0 differ
    assert _receipt(d) == before

    live = _claim(d, "job:live", "worker-d")
    assert d.effect_insert("publish:live", fingerprint(PAYLOAD), live)
    in_flight = _receipt(d, "publish:live")
    with pytest.raises(EffectConflict):
        e.effects.once("publish:live", other, target.fn(other))
    assert _receipt(d, "publish:live") == in_flight

    clock.now += TTL
    with pytest.raises(EffectOutcomeUnknown):
        e.effects.once("publish:live", PAYLOAD, target.fn(PAYLOAD))
    unknown = _receipt(d, "publish:live")
    with pytest.raises(EffectConflict):
        e.effects.once("publish:live", other, target.fn(other), retry_same_key=True)
    assert _receipt(d, "publish:live") == unknown
    assert target.keys() == [KEY]


@pytest.mark.parametrize("payload", [{1, 2}, {"when": object()}, float("nan"), b"bytes",
                                     {"amount": float("inf")}],
                         ids=["set", "object", "nan", "bytes", "inf"])
def test_payload_that_is_not_json_is_refused_before_anything_is_recorded(
        stores: list[Store], target: Target, payload: Any) -> None:
    """A payload that is not strict JSON raises PayloadNotSerializable (a LeaseError and a
    TypeError) before any receipt is written and without calling ``fn``."""
    d, _ = stores
    with pytest.raises(PayloadNotSerializable, match="JSON-serializable") as excinfo:
        d.effects.once(KEY, payload, target.fn(payload))
    assert isinstance(excinfo.value, LeaseError) and isinstance(excinfo.value, TypeError)
    assert target.calls == []
    assert d.effects.get(KEY) is None


# -- many callers at once -----------------------------------------------------------------

CALLERS = 8
_ctx = multiprocessing.get_context("spawn")


def _concurrent_caller(url: str, index: int, counter: str, barrier: Any, results: Any) -> None:
    """Child process: its own store and its own lease; all children call ``once`` on one key at
    the same instant (barrier) with ``wait=10``. ``fn`` appends a line to ``counter`` and takes
    a while, so the others find a live in-flight attempt and wait for its result."""
    try:
        store = open_store(url)
        lease = store.claim(f"caller:{index}", owner=f"caller-{index}", ttl=60)
        assert lease is not None
        store.effects.get(KEY)  # connected before the start line

        def send(idempotency_key: str) -> dict[str, Any]:
            with open(counter, "a") as out:
                out.write(f"{index} {idempotency_key}\n")
            time.sleep(0.5)
            return {"performed_by": index, "key": idempotency_key}

        barrier.wait(timeout=30)
        result = store.effects.once(KEY, PAYLOAD, send, lease=lease, wait=10)
        store.close()
        results.put(("ok", index, result))
    except BaseException:
        barrier.abort()
        results.put(("error", index, traceback.format_exc()))


def test_concurrent_callers_on_one_key_run_fn_exactly_once(
        store_url: str, tmp_path: Path) -> None:
    """8 processes, each with its own store object and lease, call ``once`` on the same key at
    the same instant (``wait=10``): ``fn`` runs exactly once (one line in the counter file) and
    every caller gets the performer's result."""
    counter = tmp_path / "calls.txt"
    counter.touch()
    barrier, results = _ctx.Barrier(CALLERS), _ctx.Queue()
    processes = [_ctx.Process(target=_concurrent_caller,
                              args=(store_url, i, str(counter), barrier, results))
                 for i in range(CALLERS)]
    for process in processes:
        process.start()
    try:
        outcomes = [results.get(timeout=60) for _ in processes]
    finally:
        for process in processes:
            process.join(10)
    errors = [detail for status, _, detail in outcomes if status != "ok"]
    assert not errors, "\n".join(errors)
    lines = counter.read_text().splitlines()
    assert len(lines) == 1, lines
    performer = int(lines[0].split()[0])
    assert lines[0] == f"{performer} {KEY}"
    assert [result for _, _, result in outcomes] == [{"performed_by": performer, "key": KEY}] * 8
    with open_store(store_url) as store:
        receipt = _receipt(store)
    assert (receipt.state, receipt.attempts, receipt.lease_owner) == (
        EffectState.DONE, 1, f"caller-{performer}")


# -- a crash between fn and the receipt: reconciliation -----------------------------------


def test_crash_after_fn_makes_the_next_owner_ask_for_reconciliation(
        stores: list[Store], target: Target, clock: ManualClock) -> None:
    """D's attempt started (in-flight receipt under D's lease), ``fn`` succeeded, and D died
    before the receipt was marked done. E, the next owner, does not resend blindly: ``once``
    raises EffectOutcomeUnknown naming D's attempt, ``fn`` is not called, and the receipt is
    ``needs_reconciliation`` (attempt 1, still D's) — and stays so on every replay. After a
    person resolves it with the result found at the target, E's ``once`` returns that result
    without calling ``fn`` and E's finish is accepted."""
    d, e = stores
    lease_d, lease_e = _crashed_attempt(stores, clock)
    for _ in range(2):
        with pytest.raises(EffectOutcomeUnknown, match="needs reconciliation") as excinfo:
            e.effects.once(KEY, PAYLOAD, target.fn(PAYLOAD), lease=lease_e)
        assert "worker-d" in str(excinfo.value)
        receipt = _receipt(e)
        assert receipt.state is EffectState.NEEDS_RECONCILIATION
        assert (receipt.attempts, receipt.lease_token, receipt.lease_owner, receipt.result) == (
            1, lease_d.token, "worker-d", None)
    assert target.calls == []

    found = {"receipt_id": "r-at-target", "key": KEY}
    resolved = e.effects.resolve(KEY, found)
    assert (resolved.state, resolved.result, resolved.attempts) == (EffectState.DONE, found, 1)
    assert e.effects.once(KEY, PAYLOAD, target.fn(PAYLOAD), lease=lease_e) == found
    assert target.calls == []
    assert e.finish(lease_e, {"sent": found}) is True
    record = d.get("job:42")
    assert record is not None
    assert (record.state, record.token, record.result) == (
        LeaseState.DONE, token_base(d) + 2, {"sent": found})
    assert d.finish(lease_d, {"stale": True}) is False


def test_retry_same_key_resends_with_the_same_key(
        stores: list[Store], target: Target, clock: ManualClock) -> None:
    """With ``retry_same_key=True`` (a target that deduplicates on the key), the next owner
    resends: ``fn`` is called again with the same key, the receipt counts 2 attempts, records
    E's lease and E's result, and is done; a further replay calls nothing."""
    d, e = stores
    _, lease_e = _crashed_attempt(stores, clock)
    result = e.effects.once(KEY, PAYLOAD, target.fn(PAYLOAD), lease=lease_e, retry_same_key=True)
    assert target.keys() == [KEY]
    assert result == {"receipt_id": "r-1", "key": KEY}
    receipt = _receipt(d)
    assert (receipt.state, receipt.attempts, receipt.result) == (EffectState.DONE, 2, result)
    assert (receipt.lease_token, receipt.lease_owner) == (lease_e.token, "worker-e")
    assert d.effects.once(KEY, PAYLOAD, target.fn(PAYLOAD), retry_same_key=True) == result
    assert target.keys() == [KEY]
    assert e.finish(lease_e, result) is True


def test_discard_lets_the_next_once_perform_again(
        stores: list[Store], target: Target, clock: ManualClock) -> None:
    """When reconciliation finds the action did not happen, ``discard(key)`` forgets the
    receipt (True; False when there is none) and the next ``once`` performs it, as attempt 1
    of a fresh receipt."""
    _, e = stores
    _, lease_e = _crashed_attempt(stores, clock)
    with pytest.raises(EffectOutcomeUnknown):
        e.effects.once(KEY, PAYLOAD, target.fn(PAYLOAD), lease=lease_e)
    assert e.effects.discard(KEY) is True
    assert e.effects.get(KEY) is None
    assert e.effects.discard(KEY) is False
    result = e.effects.once(KEY, PAYLOAD, target.fn(PAYLOAD), lease=lease_e)
    assert target.keys() == [KEY]
    receipt = _receipt(e)
    assert (receipt.state, receipt.attempts, receipt.result, receipt.lease_owner) == (
        EffectState.DONE, 1, result, "worker-e")


def test_resolve_of_an_unknown_key_is_an_error(stores: list[Store]) -> None:
    """``resolve`` never invents a receipt: for a key with none it raises LeaseError."""
    with pytest.raises(LeaseError, match="no effect receipt"):
        stores[0].effects.resolve("publish:never", {"id": 1})
    assert stores[0].effects.get("publish:never") is None


# -- live attempts, failures inside fn ----------------------------------------------------


def test_live_attempt_by_another_current_lease_is_held(
        stores: list[Store], target: Target) -> None:
    """While another lease that is still current has the effect in flight, ``once`` raises
    LeaseHeld naming it, right away without ``wait`` and after the wait with one, calls
    nothing and leaves the receipt exactly as it was."""
    d, e = stores
    lease_d = _claim(d, "job:42", "worker-d")
    assert d.effect_insert(KEY, fingerprint(PAYLOAD), lease_d)
    before = _receipt(d)
    lease_e = _claim(e, "job:43", "worker-e")
    with pytest.raises(LeaseHeld, match="worker-d"):
        e.effects.once(KEY, PAYLOAD, target.fn(PAYLOAD), lease=lease_e)
    started = time.monotonic()
    with pytest.raises(LeaseHeld):
        e.effects.once(KEY, PAYLOAD, target.fn(PAYLOAD), lease=lease_e, wait=0.3)
    assert time.monotonic() - started >= 0.15
    assert target.calls == []
    assert _receipt(e) == before


def test_wait_lasts_as_long_as_it_was_asked_to(stores: list[Store], target: Target) -> None:
    """``wait`` is the time a caller waits for a live attempt before LeaseHeld: with
    ``wait=1.0`` and an attempt that never ends, LeaseHeld comes after at least ~1 s."""
    d, e = stores
    assert d.effect_insert(KEY, fingerprint(PAYLOAD), _claim(d, "job:42", "worker-d"))
    started = time.monotonic()
    with pytest.raises(LeaseHeld):
        e.effects.once(KEY, PAYLOAD, target.fn(PAYLOAD), wait=1.0)
    assert time.monotonic() - started >= 0.95
    assert target.calls == []


def test_waiting_caller_gets_the_live_attempts_result(
        stores: list[Store], target: Target) -> None:
    """A caller with ``wait`` that finds a live attempt under way returns that attempt's result
    once it is recorded, without calling ``fn`` itself."""
    d, e = stores
    lease_d = _claim(d, "job:42", "worker-d")
    inside, proceed = threading.Event(), threading.Event()
    outcome: dict[str, Any] = {}

    def slow_send(idempotency_key: str) -> dict[str, Any]:
        inside.set()
        assert proceed.wait(10)
        return {"receipt_id": "r-slow", "key": idempotency_key}

    def performer() -> None:
        outcome["d"] = d.effects.once(KEY, PAYLOAD, slow_send, lease=lease_d)

    thread = threading.Thread(target=performer)
    thread.start()
    try:
        assert inside.wait(10)
        threading.Timer(0.3, proceed.set).start()
        got = e.effects.once(KEY, PAYLOAD, target.fn(PAYLOAD), wait=10)
    finally:
        proceed.set()
        thread.join(10)
    assert got == outcome["d"] == {"receipt_id": "r-slow", "key": KEY}
    assert target.calls == []


def test_in_flight_without_a_lease_is_live_until_the_in_flight_timeout(
        stores: list[Store], target: Target, clock: ManualClock) -> None:
    """An attempt started without a lease counts as live for ``in_flight_timeout`` seconds of
    store time (LeaseHeld), and as abandoned from then on (EffectOutcomeUnknown)."""
    d, e = stores
    assert d.effect_insert(KEY, fingerprint(PAYLOAD), None)
    clock.now += 59.0
    with pytest.raises(LeaseHeld):
        e.effects.once(KEY, PAYLOAD, target.fn(PAYLOAD), in_flight_timeout=60)
    clock.now += 1.0
    with pytest.raises(EffectOutcomeUnknown):
        e.effects.once(KEY, PAYLOAD, target.fn(PAYLOAD), in_flight_timeout=60)
    assert _receipt(e).state is EffectState.NEEDS_RECONCILIATION
    assert target.calls == []


def test_fn_raising_removes_the_receipt_so_a_later_once_performs(
        stores: list[Store], target: Target) -> None:
    """``fn`` raising an ordinary exception means the action did not happen: the exception
    propagates, the receipt is removed, and a later ``once`` performs the action."""
    d, e = stores

    def refused(idempotency_key: str) -> None:
        raise ConnectionRefusedError(f"target refused {idempotency_key}")

    with pytest.raises(ConnectionRefusedError, match=KEY):
        d.effects.once(KEY, PAYLOAD, refused, lease=_claim(d, "job:42", "worker-d"))
    assert d.effects.get(KEY) is None
    result = e.effects.once(KEY, PAYLOAD, target.fn(PAYLOAD))
    assert target.keys() == [KEY]
    receipt = _receipt(e)
    assert (receipt.state, receipt.attempts, receipt.result) == (EffectState.DONE, 1, result)


def test_fn_raising_outcome_unknown_marks_needs_reconciliation(
        stores: list[Store], target: Target) -> None:
    """``fn`` raising EffectOutcomeUnknown (e.g. a timeout after the request was sent) leaves
    the receipt ``needs_reconciliation``; the exception propagates and later calls raise it
    too without calling ``fn``."""
    d, e = stores

    def timed_out(idempotency_key: str) -> None:
        raise EffectOutcomeUnknown("read timeout after the request was sent")

    with pytest.raises(EffectOutcomeUnknown, match="read timeout"):
        d.effects.once(KEY, PAYLOAD, timed_out, lease=_claim(d, "job:42", "worker-d"))
    receipt = _receipt(e)
    assert (receipt.state, receipt.attempts, receipt.result) == (
        EffectState.NEEDS_RECONCILIATION, 1, None)
    with pytest.raises(EffectOutcomeUnknown, match="needs reconciliation"):
        e.effects.once(KEY, PAYLOAD, target.fn(PAYLOAD), lease=_claim(e, "job:43", "worker-e"))
    assert target.calls == []
    assert dataclasses.replace(_receipt(d)) == receipt


def test_result_with_a_nul_character_is_recorded_and_replayed(stores: list[Store]) -> None:
    """A result that is valid JSON but contains U+0000 (``"\\u0000"``) is recorded done and
    replayed like any other: the action, which happened, is not left in flight. (PostgreSQL
    jsonb refuses ``\\u0000``; receipt results must not be stored as jsonb.)"""
    d, e = stores
    calls: list[str] = []

    def send(idempotency_key: str) -> dict[str, str]:
        calls.append(idempotency_key)
        return {"body": "line\x00end"}

    assert d.effects.once(KEY, PAYLOAD, send) == {"body": "line\x00end"}
    assert e.effects.once(KEY, PAYLOAD, send) == {"body": "line\x00end"}
    assert calls == [KEY]
    assert _receipt(e).state is EffectState.DONE


def test_a_task_that_lost_its_lease_starts_no_new_effect(
        stores: list[Store], target: Target) -> None:
    """``self.lease.effect`` (what ``self.effect`` calls in a task body) checks the lease
    first: once the lease is known lost (a refused renewal, or no renewal before the local
    deadline) it raises LeaseLost, ``fn`` is not called and no receipt is written; while held,
    it performs under the lease (recorded on the receipt)."""
    d, _ = stores
    lease = _claim(d, "job:42", "worker-d")
    refused = Execution(lease, store=d, ttl=TTL, heartbeat_interval=1.0,
                        sent_at=time.monotonic())
    refused.mark_lost("renewal refused")
    with pytest.raises(LeaseLost, match="renewal refused"):
        refused.view.effect(KEY, PAYLOAD, target.fn(PAYLOAD))
    overdue = Execution(lease, store=d, ttl=TTL, heartbeat_interval=1.0,
                        sent_at=time.monotonic() - TTL)
    with pytest.raises(LeaseLost, match="no renewal succeeded"):
        overdue.view.effect(KEY, PAYLOAD, target.fn(PAYLOAD))
    assert target.calls == []
    assert d.effects.get(KEY) is None

    held = Execution(lease, store=d, ttl=TTL, heartbeat_interval=1.0,
                     sent_at=time.monotonic())
    assert held.view.effect(KEY, PAYLOAD, target.fn(PAYLOAD)) == {"receipt_id": "r-1",
                                                                 "key": KEY}
    receipt = _receipt(d)
    assert (receipt.lease_key, receipt.lease_token, receipt.lease_owner) == (
        "job:42", lease.token, "worker-d")


# -- the store fences the start of an action on the caller's lease --------------------------


def test_a_stale_lease_starts_no_action_even_unaware(stores: list[Store], clock: ManualClock,
                                                     target: Target) -> None:
    """A worker whose lease expired on the store's clock (though it has not noticed: no local
    check) calls ``once`` with that lease: the store refuses to create the receipt
    (LeaseLost), ``fn`` is not called and no receipt exists; the same holds for the resend of an
    abandoned attempt with ``retry_same_key``."""
    d, e = stores
    lease_d = _claim(d, "job:42", "worker-d")
    clock.now += TTL  # expired at the deadline instant
    with pytest.raises(LeaseLost, match="not current when the effect was to start"):
        d.effects.once(KEY, PAYLOAD, target.fn(PAYLOAD), lease=lease_d)
    assert target.calls == [] and d.effects.get(KEY) is None

    lease_e = _claim(e, "job:42", "worker-e")
    assert e.effect_insert(KEY, fingerprint(PAYLOAD), lease_e) is True  # E starts, then dies
    clock.now += TTL
    with pytest.raises(LeaseLost):
        e.effects.once(KEY, PAYLOAD, target.fn(PAYLOAD), lease=lease_e, retry_same_key=True)
    assert target.calls == [] and _receipt(e).lease_token == lease_e.token


def test_a_lapsed_attempt_that_succeeds_records_its_known_outcome(
        stores: list[Store], clock: ManualClock, target: Target) -> None:
    """D starts the action, its lease lapses while ``fn`` runs and E, replaying, marks the
    receipt needs_reconciliation; then D's ``fn`` returns. D knows the outcome, so the receipt
    becomes done with D's result: no reconciliation left, and E's next replay returns it."""
    d, e = stores
    lease_d = _claim(d, "job:42", "worker-d")

    def slow_send(key: str) -> dict[str, Any]:
        clock.now += TTL  # D's lease lapses while the request is out
        lease_e = _claim(e, "job:42", "worker-e")
        with pytest.raises(EffectOutcomeUnknown):
            e.effects.once(KEY, PAYLOAD, target.fn(PAYLOAD), lease=lease_e)
        assert _receipt(e).state is EffectState.NEEDS_RECONCILIATION
        return target.fn(PAYLOAD)(key)

    assert d.effects.once(KEY, PAYLOAD, slow_send, lease=lease_d) == {
        "receipt_id": "r-1", "key": KEY}
    receipt = _receipt(e)
    assert (receipt.state, receipt.result) == (EffectState.DONE, {"receipt_id": "r-1",
                                                                   "key": KEY})
    assert e.effects.once(KEY, PAYLOAD, target.fn(PAYLOAD)) == {"receipt_id": "r-1", "key": KEY}
    assert target.keys() == [KEY]


def test_discard_is_refused_while_a_live_attempt_runs_and_a_discarded_outcome_is_kept(
        stores: list[Store], clock: ManualClock, target: Target) -> None:
    """An operator cannot discard a receipt whose attempt still runs under a current lease
    (LeaseHeld). If the receipt is discarded anyway after the lease lapsed and the attempt then
    succeeds, its outcome is recorded again, so the next attempt replays instead of acting."""
    d, e = stores
    lease_d = _claim(d, "job:42", "worker-d")

    def send(key: str) -> dict[str, Any]:
        with pytest.raises(LeaseHeld, match="cannot be discarded while it runs"):
            e.effects.discard(KEY)
        clock.now += TTL  # D's lease lapses while the request is out
        assert e.effects.discard(KEY) is True  # now it may: no live attempt
        return target.fn(PAYLOAD)(key)

    assert d.effects.once(KEY, PAYLOAD, send, lease=lease_d) == {"receipt_id": "r-1",
                                                                   "key": KEY}
    lease_e = _claim(e, "job:42", "worker-e")
    assert e.effects.once(KEY, PAYLOAD, target.fn(PAYLOAD), lease=lease_e) == {
        "receipt_id": "r-1", "key": KEY}
    assert target.keys() == [KEY]


def test_payload_with_a_lone_surrogate_is_not_serializable() -> None:
    """A payload that cannot be encoded as UTF-8 is refused as PayloadNotSerializable (a
    permanent error for the policy), not a raw UnicodeEncodeError."""
    with pytest.raises(PayloadNotSerializable):
        fingerprint({"text": "\ud800"})


def test_an_insert_whose_reply_was_lost_is_recognised_as_ours(
        stores: list[Store], target: Target) -> None:
    """The driver re-sends the receipt insert after losing the reply of a first send that won:
    the store answers "exists". The in-flight receipt carries this very lease, so ``once``
    performs the action (once) instead of treating its own receipt as a live rival."""
    d, _ = stores
    lease = _claim(d, "job:42", "worker-d")
    assert d.effect_insert(KEY, fingerprint(PAYLOAD), lease) is True  # the first send
    assert d.effects.once(KEY, PAYLOAD, target.fn(PAYLOAD), lease=lease) == {
        "receipt_id": "r-1", "key": KEY}
    assert target.keys() == [KEY]
    assert _receipt(d).state is EffectState.DONE
