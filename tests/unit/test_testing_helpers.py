"""lease_celery.testing: the helpers users get for their own tests."""

from __future__ import annotations

import pytest

from lease_celery import LeaseState
from lease_celery.testing import ManualClock, scratch_store


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
