"""``lease_unique``: a publish of a key that already has a holder returns that holder's
``AsyncResult`` instead of a new message (lease_celery.execution.unique).

The publisher here is a Celery app of the test's own that defines the same LeasedTask (as a
producer would), on the workers' broker, queue and lease store; the workers are real.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from celery import Celery
from celery.signals import before_task_publish

from lease_celery import LeasedTask, open_store
from lease_celery.errors import ConfigError
from lease_celery.execution.unique import existing_holder
from lease_celery.models import LeaseState
from tests.support.servers import REDIS_URL
from tests.support.workers import WorkerPool

NAME = "tests.support.worker_app.unique_work"


def _publisher(workers: WorkerPool) -> Any:
    app = Celery(f"unique-publisher-{uuid.uuid4().hex[:6]}", broker=REDIS_URL,
                 backend=REDIS_URL, set_as_current=False)
    app.conf.update(task_default_queue=workers.env["LEASE_TEST_QUEUE"],
                    lease_store_url=workers.store_url)

    @app.task(bind=True, base=LeasedTask, name=NAME, lease_key="job:{job_id}",
              lease_unique=True, shared=False)
    def unique_work(self: LeasedTask, job_id: str, seconds: float = 0.0) -> None:
        raise AssertionError("runs in the workers only")

    app.finalize()
    return unique_work


@pytest.mark.worker_env(LEASE_TEST_TTL="2", LEASE_TEST_HEARTBEAT="0.5")
def test_a_unique_publish_returns_the_running_then_the_done_holder(
        workers: WorkerPool) -> None:
    """While the key runs, and after it is done, ``apply_async`` hands back the first
    delivery's ``AsyncResult``: no second message (one ``task_received``), one body run.
    ``lease_unique=False`` on the call publishes anyway."""
    workers.start("a", concurrency=2)
    task = _publisher(workers)
    job = uuid.uuid4().hex[:10]
    first = task.apply_async((job, 2.0))
    workers.journal.wait_for(lambda j: bool(j.events("body_start", job_id=job)), timeout=20,
                             what="the first delivery to start")
    again = task.apply_async((job, 2.0))
    assert again.id == first.id
    accepted = first.get(timeout=20)
    after = task.delay(job)
    assert after.id == first.id and after.get(timeout=5) == accepted
    received = [e for e in workers.journal.events("task_received")
                if e["task_id"] == first.id or e["task"] == NAME]
    assert [e["task_id"] for e in received] == [first.id]
    forced = task.apply_async((job,), lease_unique=False)
    assert forced.id != first.id and forced.get(timeout=20) == accepted  # answered
    assert len(workers.journal.events("body_start", job_id=job)) == 1


@pytest.mark.worker_env(LEASE_TEST_TTL="2", LEASE_TEST_HEARTBEAT="0.5")
def test_a_deferred_duplicate_of_a_unique_task_still_arrives(workers: WorkerPool) -> None:
    """A duplicate that reached a worker anyway (published without the check, as a double
    publish racing the first would) is deferred while the key runs. Its re-publish must not be
    swallowed by the unique check: it arrives and is answered with the accepted result."""
    workers.start("a", concurrency=2)
    job = uuid.uuid4().hex[:10]
    first = workers.client.send_task(NAME, args=(job, 2.0))
    workers.journal.wait_for(lambda j: bool(j.events("body_start", job_id=job)), timeout=20,
                             what="the first delivery to start")
    duplicate = workers.client.send_task(NAME, args=(job, 2.0))
    accepted = first.get(timeout=20)
    assert duplicate.get(timeout=20) == accepted
    assert len(workers.journal.events("body_start", job_id=job)) == 1


def test_lease_unique_per_call_when_the_task_option_is_off(sqlite_url: str) -> None:
    """On a task whose ``lease_unique`` is False (the default), ``apply_async(...,
    lease_unique=True)`` returns the AsyncResult of the key's holder and publishes nothing;
    the same call without it (or ``delay``) publishes as usual, as does a unique call for a
    key nobody holds."""
    app = Celery("unique-per-call", broker="memory://", set_as_current=False)
    app.conf.update(lease_store_url=sqlite_url)

    @app.task(bind=True, base=LeasedTask, lease_key="u:{n}", shared=False)
    def keyed(self: LeasedTask, n: int) -> None: ...

    app.finalize()
    assert keyed.lease_unique is False
    published: list[str] = []

    def on_publish(sender: Any = None, headers: Any = None, **_: Any) -> None:
        if sender == keyed.name:
            published.append(headers["id"])

    before_task_publish.connect(on_publish, weak=False)
    try:
        info = {"task": keyed.name, "args": [1], "kwargs": {}, "options": {"task_id": "t-1"}}
        with open_store(sqlite_url) as store:
            assert store.claim("u:1", owner="w", ttl=30, task=info) is not None
        held = keyed.apply_async((1,), lease_unique=True)
        assert held.id == "t-1" and published == []
        plain = keyed.apply_async((1,))
        assert plain.id != "t-1" and published == [plain.id]
        delayed = keyed.delay(1)
        assert published == [plain.id, delayed.id]
        fresh = keyed.apply_async((2,), lease_unique=True)
        assert published == [plain.id, delayed.id, fresh.id]
    finally:
        before_task_publish.disconnect(on_publish)


def test_which_rows_stand_for_the_work(sqlite_url: str) -> None:
    """A running, ready or done row with a task id returns that id; no row, a dead key, or the
    holder publishing itself again (Celery's retry) publishes; a key by task id with no id
    given has nothing to look up; a bad key fails at publish."""
    app = Celery("unique-units", broker="memory://", set_as_current=False)
    app.conf.update(lease_store_url=sqlite_url)

    @app.task(bind=True, base=LeasedTask, lease_key="u:{n}", shared=False)
    def keyed(self: LeasedTask, n: int) -> None: ...

    @app.task(bind=True, base=LeasedTask, shared=False)
    def by_id(self: LeasedTask) -> None: ...

    app.finalize()
    info = {"task": keyed.name, "args": [1], "kwargs": {}, "options": {"task_id": "t-1"}}
    with open_store(sqlite_url) as store:
        assert existing_holder(keyed, (1,), {}, None) is None
        lease = store.claim("u:1", owner="w", ttl=30, task=info)
        assert lease is not None
        assert existing_holder(keyed, (1,), {}, None).id == "t-1"
        assert existing_holder(keyed, (1,), {}, "t-1") is None  # its own retry
        assert store.release(lease, reason="retry")
        assert store.get("u:1").state is LeaseState.READY  # type: ignore[union-attr]
        assert existing_holder(keyed, (1,), {}, None).id == "t-1"
        lease = store.claim("u:1", owner="w", ttl=30, task=info)
        assert lease is not None and store.finish(lease, 1)
        assert store.get("u:1").state is LeaseState.DONE  # type: ignore[union-attr]
        assert existing_holder(keyed, (1,), {}, None).id == "t-1"
        dead = store.claim("u:2", owner="w", ttl=30, task={**info, "args": [2]})
        assert dead is not None and store.kill(dead, reason="gave up")
        assert existing_holder(keyed, (2,), {}, None) is None
    assert existing_holder(by_id, (), {}, None) is None
    with pytest.raises(Exception, match="lease_key"):
        existing_holder(keyed, (), {"other": 1}, None)
    with pytest.raises(ConfigError, match="lease_unique"):
        @app.task(bind=True, base=LeasedTask, lease_unique="yes", shared=False)
        def bad(self: LeasedTask) -> None: ...
