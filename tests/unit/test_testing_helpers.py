"""lease_celery.testing: the helpers users get for their own tests."""

from __future__ import annotations

from pathlib import Path

import pytest
from celery import Celery

from lease_celery import LeaseDone, LeasedTask, LeaseState, Store
from lease_celery.testing import ManualClock, scratch_leases, scratch_store


def test_manual_clock_drives_expiry_in_a_scratch_store() -> None:
    """The docstring's example: a lease expires exactly when the manual clock reaches it."""
    clock = ManualClock(1_000.0)
    with scratch_store(clock=clock) as store:
        lease = store.claim("report:1", owner="me", ttl=10)
        assert lease is not None and lease.expires_at == 1_010.0
        clock.advance(9.999)
        assert store.claim("report:1", owner="other", ttl=10) is None
        clock.advance(0.001)
        assert store.finish(lease, "late") is False
        fresh = store.claim("report:1", owner="other", ttl=10)
        assert fresh is not None and fresh.token == 2
        assert store.finish(fresh, "ok") is True
        record = store.get("report:1")
        assert record is not None and record.state is LeaseState.DONE


def test_manual_clock_never_goes_backwards() -> None:
    """Moving the clock back is refused: leases assume the authority clock is monotonic."""
    clock = ManualClock(10.0)
    with pytest.raises(ValueError, match="backwards"):
        clock.advance(-1)
    with pytest.raises(ValueError, match="backwards"):
        clock.set(5.0)
    clock.set(20.0)
    assert clock() == 20.0


def test_scratch_leases_gives_each_block_an_empty_store_for_the_apps_tasks(
        tmp_path: Path) -> None:
    """An app's LeasedTasks, eager, inside ``scratch_leases``: the first run of a key runs
    and finishes in the scratch store (on the manual clock), a second runs nothing and is
    answered with the accepted result, a direct call raises ``LeaseDone``; the next block
    starts empty; the app's own store and a task's own ``lease_store_url`` are untouched and
    restored."""
    own = f"sqlite:///{tmp_path}/own.sqlite3"
    app = Celery("scratch", broker="memory://", set_as_current=False)
    app.conf.update(task_always_eager=True, lease_store_url=f"sqlite:///{tmp_path}/app.sqlite3")
    runs: list[int] = []

    @app.task(base=LeasedTask, shared=False, lease_key="report:{n}")
    def report(n: int) -> int:
        runs.append(n)
        return n

    @app.task(base=LeasedTask, shared=False, lease_key="other:{n}", lease_store_url=own)
    def other(n: int) -> int:
        return n

    app.finalize()
    clock = ManualClock(5_000.0)
    for _ in range(2):
        with scratch_leases(app, clock=clock) as store:
            assert report.delay(42).get() == 42
            assert report.apply(args=(42,)).get() == 42  # answered: runs counts one
            with pytest.raises(LeaseDone, match="'report:42' is done with token 1"):
                report(42)
            assert other.delay(1).get() == 1
            record = store.get("report:42")
            assert record is not None and record.state is LeaseState.DONE
            assert record.updated_at == 5_000.0  # the manual clock's time
            assert store.get("other:1") is not None
    assert runs == [42, 42]
    assert report.lease_settings.store_url == f"sqlite:///{tmp_path}/app.sqlite3"
    assert other.lease_settings.store_url == own
    assert not (tmp_path / "app.sqlite3").exists() and not (tmp_path / "own.sqlite3").exists()


def test_the_pytest_fixtures_come_with_the_package(lease_store: Store,
                                                   lease_clock: ManualClock) -> None:
    """``lease_store`` and ``lease_clock`` (the package's pytest11 entry point): a scratch
    store on a manual clock."""
    lease = lease_store.claim("k", owner="me", ttl=10)
    assert lease is not None and lease.expires_at == lease_clock.now + 10
    lease_clock.advance(10)
    assert lease_store.claim("k", owner="other", ttl=10) is not None
