"""pytest fixtures for users' tests of their LeasedTasks (loaded through the package's
``pytest11`` entry point; ``-p no:lease_celery`` turns them off).

``lease_clock``: a :class:`~lease_celery.testing.ManualClock` at 1,000,000 s, moved only by
the test. ``lease_store``: a scratch SQLite store on that clock, removed after the test. For an
app's tasks, ``with lease_celery.testing.scratch_leases(app, clock=lease_clock) as store:``.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from .stores.base import Store
from .testing import ManualClock, scratch_store

__all__ = ["lease_clock", "lease_store"]


@pytest.fixture
def lease_clock() -> ManualClock:
    """An authority clock that moves only when the test says so."""
    return ManualClock()


@pytest.fixture
def lease_store(lease_clock: ManualClock) -> Iterator[Store]:
    """A store of this test's own (SQLite, in a temporary directory) on ``lease_clock``."""
    with scratch_store(clock=lease_clock) as store:
        yield store
