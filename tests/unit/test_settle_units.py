"""The settle protocol's task-side pieces, in process: callback ids derived from the task id,
and the confirmation that a subclass's own ``after_return`` cannot skip."""

from __future__ import annotations

from typing import Any

from celery import Celery, group
from celery.app.task import Context

from lease_celery import LeasedTask, signals
from lease_celery.execution.settle import confirm_stored, freeze_links
from lease_celery.runtime.execution import Execution, Phase
from lease_celery.runtime.heartbeat import Heartbeat
from tests.support.policy_helpers import wait_until


def _request(task_id: str, app: Celery) -> Context:
    link = app.signature("proj.callback", args=("a",))
    frozen = app.signature("proj.callback", args=("b",))
    frozen.freeze("fixed-id")
    both = group(app.signature("proj.member", args=(1,)), app.signature("proj.member", args=(2,)))
    errback = app.signature("proj.errback")
    return Context(id=task_id, callbacks=[dict(link), dict(frozen), dict(both)],
                   errbacks=[dict(errback)])


def test_callbacks_get_ids_derived_from_the_task_id() -> None:
    """Every execution of one task id sends its callbacks (group members too) and errbacks
    under the same ids; another task id gets other ids; ids set by the publisher are kept."""
    app = Celery("settle-units", set_as_current=False)
    first, again, other = (_request(t, app) for t in ("task-1", "task-1", "task-2"))
    for request in (first, again, other):
        freeze_links(request)

    def ids(request: Context) -> list[Any]:
        link, frozen, both = request.callbacks
        members = [m["options"]["task_id"] for m in both["kwargs"]["tasks"]]
        return [link["options"]["task_id"], frozen["options"]["task_id"],
                both["options"]["task_id"], *members,
                request.errbacks[0]["options"]["task_id"]]

    assert ids(first) == ids(again)
    assert len(set(ids(first))) == 6  # all distinct
    assert ids(first)[1] == "fixed-id" == ids(other)[1]
    assert not set(ids(first)) - {"fixed-id"} & set(ids(other))
    freeze_links(first)  # a second pass (a redelivery in the same process) changes nothing
    assert ids(first) == ids(again)
    freeze_links(Context(id=None, callbacks=None))  # nothing to derive from: untouched


class _Store:
    def __init__(self) -> None:
        self.settled: list[Any] = []

    def settle_many(self, leases: list[Any]) -> list[bool]:
        self.settled += leases
        return [True] * len(leases)


def test_a_subclass_after_return_cannot_skip_the_settle_confirmation() -> None:
    """A LeasedTask subclass whose own ``after_return`` does not call ``super()`` still ends
    the settle phase of a stored SUCCESS; a RETRY (nothing stored) confirms nothing."""
    calls: list[str] = []

    class Mine(LeasedTask):
        name = "tests.settle_units.mine"

        def after_return(self, status: str, *args: Any, **kwargs: Any) -> None:
            calls.append(status)

    from lease_celery.models import Lease

    store = _Store()
    lease = Lease("k", "me", 1, 0.0)
    handle = Execution(lease, store=store,  # type: ignore[arg-type]
                         ttl=10, heartbeat_interval=1, sent_at=0.0)
    handle.enter(Phase.SETTLING)
    app = Celery("settle-units-2", set_as_current=False)
    task = app.register_task(Mine())
    task.push_request(lease=handle)
    try:
        task.after_return("RETRY", None, "id", (), {}, None)
        assert handle.phase is Phase.SETTLING and calls == ["RETRY"]
        task.after_return("SUCCESS", 1, "id", (), {}, None)
        assert handle.phase is Phase.CONFIRMING and calls == ["RETRY", "SUCCESS"]
    finally:
        task.pop_request()
    Heartbeat.for_process().confirmations.flush()
    assert store.settled == [lease]
    confirm_stored(handle, "SUCCESS")  # once only
    Heartbeat.for_process().confirmations.flush()
    assert store.settled == [lease]


def _trace(app: Celery, task: Any, task_id: str, args: tuple[Any, ...],
           **request: Any) -> Any:
    """Run ``task`` as a worker would (Celery's tracer, not eager), in this process."""
    from celery.app.trace import build_tracer

    tracer = build_tracer(task.name, task, app=app, eager=False, propagate=True)
    message = {"id": task_id, "task": task.name, "args": list(args), "kwargs": {},
               "delivery_info": {"routing_key": "celery", "exchange": "", "priority": 0,
                                 "redelivered": False}, "hostname": "test", **request}
    return tracer(task_id, args, {}, message)


def test_a_result_nobody_stores_or_sends_settles_in_the_finish_itself(
        sqlite_url: str) -> None:
    """Through Celery's own tracer: an ignored result with no callback settles at once (no
    settle write); with a ``link`` the key goes through the settle phase, confirmed by the
    heartbeat once Celery sent the callback."""
    app = Celery("settle-units-trace", broker="memory://", backend="disabled://",
                 set_as_current=False)
    app.conf.update(lease_store_url=sqlite_url, task_ignore_result=True,
                    lease_sweep_interval=0)

    @app.task(bind=True, base=LeasedTask, lease_key="unit:{n}", shared=False)
    def quiet(self: LeasedTask, n: int) -> int:
        return n

    app.finalize()
    settled: list[str] = []

    def on_settled(sender: Any = None, key: str = "", **_: Any) -> None:
        settled.append(key)

    signals.lease_settled.connect(on_settled, weak=False)
    try:
        _run_quiet_and_linked(app, quiet, sqlite_url)
    finally:
        signals.lease_settled.disconnect(on_settled)
    assert settled == ["unit:2"]  # only the linked one went through a settle phase


def _run_quiet_and_linked(app: Celery, quiet: Any, sqlite_url: str) -> None:
    from lease_celery import open_store

    with open_store(sqlite_url) as store:
        _trace(app, quiet, "t-quiet", (1,))
        Heartbeat.for_process().writes.flush(5.0)  # its finish is written behind the return
        record = store.get("unit:1")
        assert record is not None and record.state.value == "done" and not record.settling
        link = app.signature("proj.callback")
        _trace(app, quiet, "t-linked", (2,), callbacks=[dict(link)])
        Heartbeat.for_process().confirmations.flush()
        # (A sender thread may have taken the confirmation just before the flush, and still
        # be writing it: under load that took a moment, and the row was read before it.)
        record = wait_until(lambda: (found := store.get("unit:2")) is not None
                            and not found.settling and found,
                            timeout=5.0, what="unit:2's settle confirmation", interval=0.01)
        assert record.state.value == "done" and not record.settling
