"""The sweeper's store-level contract: each expired generation is re-published once, and a
re-publish that failed is tried again by the next sweep (real stores; a real Redis broker, and
one that is down)."""

from __future__ import annotations

from lease_celery import open_store
from lease_celery.testing import ManualClock
from lease_celery.worker.sweeper import sweep
from tests.support.queues import DOWN_BROKER, own_queue, published, publishing_app
from tests.support.tokens import token_base

TASK = {"task": "proj.tasks.build", "args": [42], "kwargs": {}, "options": {"task_id": "t-42"}}


def test_failed_republish_is_retried_by_the_next_sweep(store_url: str) -> None:
    """A dead owner's lease expires; the first sweep marks it but cannot publish (broker down):
    the mark is undone, so the next sweep publishes it, once; later sweeps leave it alone."""
    clock = ManualClock(1_000.0)
    with own_queue() as queue, open_store(store_url, clock=clock) as store:
        app, down = publishing_app(queue), publishing_app(queue, broker=DOWN_BROKER)
        assert store.claim("build:42", owner="dead-worker", ttl=10, task=TASK) is not None
        assert sweep(app, store) == []  # not expired yet
        clock.advance(10)
        assert sweep(down, store) == []  # marked, not published: unmarked for the next sweep
        assert published(queue) == []
        assert [r.key for r in sweep(app, store)] == ["build:42"]
        sent = [(m["task"], m["id"], m["args"]) for m in published(queue)]
        assert sent == [("proj.tasks.build", "t-42", [42])]
        assert sweep(app, store) == []
        assert len(published(queue)) == 1
        # A new owner takes it over and also dies: that generation is swept again, once.
        assert store.claim("build:42", owner="next-worker", ttl=10, task=TASK) is not None
        clock.advance(10)
        assert [r.token for r in sweep(app, store)] == [token_base(store) + 2]
        assert len(published(queue)) == 2


def test_a_dead_slot_holders_waiters_are_handed_on_by_the_sweep(store_url: str) -> None:
    """A limit group's holder dies: nobody hands its waiters on. Once its lease expires, a
    sweep publishes the first waiter (and the dead holder's own task), and, should that
    message be lost, publishes it again a grace period later, not before."""
    from lease_celery.limits import GroupLimit
    from lease_celery.worker.sweeper import sweep_report

    clock = ManualClock(1_000.0)
    group = GroupLimit("tenant:7", limit=1)
    waiter = {**TASK, "args": [43], "options": {"task_id": "t-43"}}
    with own_queue() as queue, open_store(store_url, clock=clock) as store:
        app = publishing_app(queue)
        assert store.claim_limited("build:42", owner="dead-worker", ttl=10, limit=group,
                                   task=TASK) is not None
        refused = store.claim_limited("build:43", owner="w", ttl=10, limit=group, task=waiter)
        assert refused is not None and getattr(refused, "parked", False)
        assert sweep_report(app, store).handed_on == []  # the slot is still held
        clock.advance(10)
        report = sweep_report(app, store, grace=60)
        assert [w.key for w in report.handed_on] == ["build:43"]
        assert sorted(m["id"] for m in published(queue)) == ["t-42", "t-43"]
        assert sweep_report(app, store, grace=60).handed_on == []  # within the grace
        clock.advance(61)
        assert [w.key for w in sweep_report(app, store, grace=60).handed_on] == ["build:43"]
