"""Retention (``lease_retention``): the sweeper prunes old settled done/dead rows in small
batches, oldest first, on every store; rows still settling, running or ready are kept, and a
pruned key claimed again continues its tokens."""

from __future__ import annotations

import pytest

from lease_celery import LeaseState, Store
from lease_celery.errors import ConfigError
from lease_celery.testing import ManualClock
from lease_celery.worker.sweeper import prune
from tests.support.tokens import token_base


@pytest.fixture
def store(stores: list[Store]) -> Store:
    return stores[0]


def _done(store: Store, key: str, *, settle: bool = False) -> None:
    lease = store.claim(key, owner="w", ttl=10)
    assert lease is not None
    assert store.finish(lease, {"k": key}, settle_within=5 if settle else None)


class App:
    """Stands in for a Celery app: only ``conf`` is read."""

    def __init__(self, **conf: object) -> None:
        self.conf = conf


def test_purge_with_a_limit_removes_the_oldest_settled_terminal_rows_first(
        store: Store, clock: ManualClock) -> None:
    """purge_older_than(60, limit=2) removes the two oldest settled done/dead rows; a row still
    settling, a running and a ready one are kept however old; tokens continue after a purge."""
    for n in range(4):
        _done(store, f"old:{n}")
        clock.advance(1)
    lease = store.claim("dead", owner="w", ttl=10)
    assert lease is not None and store.kill(lease, reason="gave up")
    _done(store, "settling", settle=True)
    running = store.claim("running", owner="w", ttl=1000)
    assert running is not None
    ready = store.claim("ready", owner="w", ttl=10)
    assert ready is not None and store.release(ready)
    clock.advance(100)
    assert store.purge_older_than(60, limit=2) == 2
    assert store.get("old:0") is None and store.get("old:1") is None
    assert store.get("old:2") is not None
    assert store.purge_older_than(60, limit=10) == 3  # old:2, old:3, dead
    assert store.purge_older_than(60, limit=10) == 0
    kept = {r.key: r.state for r in store.find()}
    assert kept == {"settling": LeaseState.DONE, "running": LeaseState.RUNNING,
                    "ready": LeaseState.READY}
    again = store.claim("old:0", owner="w2", ttl=10)
    assert again is not None and again.token == token_base(store) + 2
    with pytest.raises(ConfigError):
        store.purge_older_than(60, limit=0)


def test_the_sweeper_prunes_by_lease_retention_and_zero_keeps_everything(
        store: Store, clock: ManualClock) -> None:
    """prune() uses the app's lease_retention (default 7 days) in batches of ``limit``; 0 keeps
    rows forever; a bad value is refused naming the setting."""
    for n in range(3):
        _done(store, f"r:{n}")
    clock.advance(3600)
    assert prune(App(), store) == 0  # 1 h old: the 7-day default keeps them
    assert prune(App(lease_retention=0), store) == 0
    assert prune(App(lease_retention=60), store, limit=2) == 2
    assert prune(App(lease_retention=60), store, limit=2) == 1
    assert store.find() == []
    with pytest.raises(ConfigError, match="lease_retention"):
        prune(App(lease_retention=-1), store)
