"""Per-key history: the stores keep it (every store) and write each transition themselves,
lease_celery's signals add what is no transition (in batches off the task's path), the
sweeper and the CLI's operator actions add theirs, and ``celery leases history`` / ``show``
print it (keys and reasons are user data)."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest
from celery import Celery
from celery.app.trace import build_tracer
from click.testing import CliRunner

from lease_celery import LeasedTask, open_store
from lease_celery.cli import leases
from lease_celery.models import HistoryEntry
from lease_celery.runtime import history
from lease_celery.stores.base import Store
from lease_celery.testing import ManualClock
from tests.support.tokens import token_base


@pytest.fixture
def store(stores: list[Store]) -> Store:
    return stores[0]


def test_a_store_keeps_each_keys_events_in_order_and_across_keys(
        store: Store, clock: ManualClock) -> None:
    t = time.time() - 100
    store.record_history_many([
        HistoryEntry("a", t, "claimed", "w1", 1, 7),
        HistoryEntry("b", t + 1, "claimed", "w2", 1, 8),
        HistoryEntry("a", t + 2, "taken_over", "w3", 2, 9, "lapsed"),
        HistoryEntry("a", t + 3, "finished", "w3", 2, 9),
    ])
    store.record_history("a", "operator:release", detail="ann@host: <script>x</script>")
    events = [(e.event, e.token) for e in store.history("a")]
    assert events == [("claimed", 1), ("taken_over", 2), ("finished", 2),
                      ("operator:release", None)]
    assert [e.event for e in store.history("a", limit=2)] == ["finished", "operator:release"]
    assert store.history("a")[-1].detail == "ann@host: <script>x</script>"
    assert store.history("nothing") == []
    recent = store.recent_history(events=["taken_over", "claimed"], limit=10)
    assert [(e.key, e.event) for e in recent] == [("a", "taken_over"), ("b", "claimed"),
                                                  ("a", "claimed")]
    assert len(store.recent_history(limit=2)) == 2


def test_the_store_records_each_transition_in_the_statement_that_makes_it(
        store: Store, clock: ManualClock) -> None:
    """Every store writes a key's transitions itself (no writer thread, nothing flushed):
    claimed, taken_over naming the lapsed holder, retry with its backoff, released, dead with
    its reason, finished, and completed when another delivery takes over an unsettled finish.
    Renewals, checkpoints and settle confirmations write nothing."""
    first = store.claim("tr", owner="w1", ttl=10)
    assert first is not None
    assert store.renew(first, ttl=10) is not None
    assert store.checkpoint(first, '{"step": 1}')
    clock.advance(11)
    second = store.claim("tr", owner="w2", ttl=10)
    assert second is not None
    assert store.release(second, delay=5, reason="busy <b>")
    clock.advance(6)
    third = store.claim("tr", owner="w3", ttl=10)
    assert third is not None and store.release(third, reason="shutting down")
    fourth = store.claim("tr", owner="w4", ttl=10)
    assert fourth is not None and store.kill(fourth, reason="boom <script>")
    assert store.requeue("tr", reason="operator") is not None
    fifth = store.claim("tr", owner="w5", ttl=10)
    assert fifth is not None and store.finish(fifth, 1, settle_within=5)
    clock.advance(6)
    completer = store.claim_settlement("tr", owner="w6", ttl=10)
    assert completer is not None and store.settle(completer)
    entries = store.history("tr")
    base = token_base(store)
    assert [(e.event, e.owner, e.token) for e in entries] == [
        ("claimed", "w1", base + 1), ("taken_over", "w2", base + 2), ("retry", "w2", base + 2),
        ("claimed", "w3", base + 3), ("released", "w3", base + 3), ("claimed", "w4", base + 4),
        ("dead", "w4", base + 4), ("claimed", "w5", base + 5), ("finished", "w5", base + 5),
        ("completed", "w6", base + 5)]
    details = {e.event: e.detail for e in entries}
    assert details["taken_over"] == f"the lease of w1 (token {base + 1}) had lapsed"
    assert details["retry"] == "busy <b>; claimable again in 5.00s"
    assert details["released"] == "shutting down"
    assert details["dead"] == "boom <script>"
    assert details["claimed"] is None and details["finished"] is None
    assert "w5" in (details["completed"] or "")
    assert [e.at for e in entries] == sorted(e.at for e in entries)
    assert entries[0].fence == first.fence and entries[1].fence == second.fence
    assert entries[-2].fence == fifth.fence
    taken = store.recent_history(events=["taken_over"], limit=5)
    assert [(e.key, e.token) for e in taken] == [("tr", base + 2)]


def test_history_older_than_the_retention_is_pruned(store: Store) -> None:
    old = time.time() - 10 * 86400
    store.record_history_many([HistoryEntry("k", old, "claimed"),
                               HistoryEntry("k", time.time(), "finished")])
    pruned = store.prune_history(7 * 86400)
    if type(store).__name__ == "RedisStore":
        assert pruned == 0  # capped per key and deleted with the key instead
    else:
        assert pruned == 1 and [e.event for e in store.history("k")] == ["finished"]


def _trace(app: Celery, task: Any, task_id: str, *args: Any) -> Any:
    tracer = build_tracer(task.name, task, app=app, eager=False, propagate=False)
    message = {"id": task_id, "task": task.name, "args": list(args), "kwargs": {},
               "delivery_info": {"routing_key": "celery", "exchange": "", "priority": 0,
                                 "redelivered": False}, "hostname": "test"}
    return tracer(task_id, args, {}, message)


def test_a_runs_events_reach_the_history_and_are_printed_by_the_cli(sqlite_url: str) -> None:
    """Through Celery's tracer: the claim and the finish of a run and a dead key's reason are
    in the history (the store wrote them); ``history`` and ``show`` print them with the
    operator's own actions."""
    app = Celery("history-units", broker="memory://", backend="disabled://",
                 set_as_current=False)
    app.conf.update(lease_store_url=sqlite_url, task_ignore_result=True,
                    lease_sweep_interval=0, lease_max_attempts=1)

    @app.task(bind=True, base=LeasedTask, lease_key="hist:{n}", shared=False)
    def job(self: LeasedTask, n: int) -> int:
        if n < 0:
            raise RuntimeError("boom <b>")
        return n

    app.finalize()
    _trace(app, job, "t-1", 1)
    _trace(app, job, "t-2", -1)
    from lease_celery.runtime.heartbeat import Heartbeat

    Heartbeat.for_process().writes.flush(5.0)
    history.flush()
    with open_store(sqlite_url) as store:
        ok = store.history("hist:1")
        failed = store.history("hist:-1")
    assert [(e.event, e.token) for e in ok] == [("claimed", 1), ("finished", 1)]
    assert ok[0].owner is not None and ok[0].owner == ok[1].owner
    assert [e.event for e in failed] == ["claimed", "dead"]
    assert "boom <b>" in (failed[1].detail or "")

    runner = CliRunner()
    named = SimpleNamespace(app=app, load_error=None)  # what `celery -A …` hands the group
    printed = runner.invoke(leases, ["--store", sqlite_url, "history", "hist:-1"], obj=named)
    assert printed.exit_code == 0, printed.output
    assert "claimed token 1" in printed.output and "dead token 1" in printed.output
    assert "boom <b>" in printed.output
    requeued = runner.invoke(leases, ["--store", sqlite_url, "requeue", "hist:-1",
                                      "--no-publish"], obj=named)
    assert requeued.exit_code == 0, requeued.output
    shown = runner.invoke(leases, ["--store", sqlite_url, "show", "hist:-1"], obj=named)
    assert "operator:requeue" in shown.output and "via the CLI" in shown.output
    missing = runner.invoke(leases, ["--store", sqlite_url, "history", "nope"], obj=named)
    assert missing.exit_code == 1 and "no history" in missing.output


def test_history_many_reads_the_histories_of_many_keys_in_one_call(store: Store) -> None:
    """``history_many(keys, limit=n)`` gives each key what ``history(key, limit=n)`` gives,
    oldest first, and ``[]`` for a key without events: what the dashboard's /running page
    reads for all its rows at once (one history query per row before)."""
    keys = [f"many:{n}" for n in range(4)]
    for n, key in enumerate(keys[:3]):
        for event in range(n + 2):
            store.record_history(key, f"e{event}", owner="w", token=event)
    got = store.history_many([*keys, keys[0]], limit=3)
    assert set(got) == set(keys)
    for key in keys:
        assert got[key] == store.history(key, limit=3), key
    assert got["many:3"] == [] and [e.event for e in got["many:2"]] == ["e1", "e2", "e3"]
    assert store.history_many([], limit=3) == {}
