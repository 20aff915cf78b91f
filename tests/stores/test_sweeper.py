"""The sweeper's store-level contract: each expired generation is re-published once, and a
re-publish that failed is tried again by the next sweep (real stores; the broker is replaced
by a publisher that fails on demand, since the point is what the sweeper does when it does)."""

from __future__ import annotations

from typing import Any

from lease_celery import open_store
from lease_celery.testing import ManualClock
from lease_celery.worker.sweeper import sweep
from tests.support.tokens import token_base

TASK = {"task": "proj.tasks.build", "args": [42], "kwargs": {}, "options": {"task_id": "t-42"}}


class Publisher:
    """Stands in for the app: ``signature(info).apply_async()`` records or fails."""

    def __init__(self) -> None:
        self.down = False
        self.published: list[dict[str, Any]] = []

    def signature(self, info: dict[str, Any]) -> Any:
        publisher = self

        class Sig:
            def apply_async(self, **_: Any) -> None:
                if publisher.down:
                    raise ConnectionError("broker unreachable")
                publisher.published.append(info)

        return Sig()


def test_failed_republish_is_retried_by_the_next_sweep(store_url: str) -> None:
    """A dead owner's lease expires; the first sweep marks it but cannot publish (broker down):
    the mark is undone, so the next sweep publishes it, once; later sweeps leave it alone."""
    clock = ManualClock(1_000.0)
    app = Publisher()
    with open_store(store_url, clock=clock) as store:
        assert store.claim("build:42", owner="dead-worker", ttl=10, task=TASK) is not None
        assert sweep(app, store) == []  # not expired yet
        clock.advance(10)
        app.down = True
        assert sweep(app, store) == []  # marked, not published: unmarked for the next sweep
        assert app.published == []
        app.down = False
        assert [r.key for r in sweep(app, store)] == ["build:42"]
        assert app.published == [TASK]
        assert sweep(app, store) == []
        assert app.published == [TASK]
        # A new owner takes it over and also dies: that generation is swept again, once.
        assert store.claim("build:42", owner="next-worker", ttl=10, task=TASK) is not None
        clock.advance(10)
        assert [r.token for r in sweep(app, store)] == [token_base(store) + 2]
        assert len(app.published) == 2
