"""The reference model and every store, driven by the same operations (the short profile of
``tests/stores/model_machine.py``): every answer and every row must agree."""

from __future__ import annotations

import sqlite3

import pytest

from lease_celery import ConfigError, LeaseState, open_store
from lease_celery.app_connections import app_connection
from tests.conftest import STORES
from tests.stores.app_tx_machine import run as run_app_transactions
from tests.stores.model_machine import run


@pytest.mark.parametrize("kind", STORES)
def test_every_store_answers_as_the_model_does(kind: str) -> None:
    """Claims, renewals, finishes (carried by a claim too), releases, kills, settle phases,
    operator actions, the sweeper, retention, effect receipts and limits, on a clock that
    jumps and stops exactly at deadlines, with owner names reused, under restarts, killed
    connections, lost replies and (Redis) a server that lost its data: the store's answers
    and rows are the model's."""
    run(kind, "short")


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
def test_app_transactions_answer_as_the_model_does(kind: str) -> None:
    """Completions in the app's own transaction (lock_in, the body's rows, finish_in, commit
    or rollback, the clock moving in between) and enqueues in it (record_published_in), among
    the store's own calls: the rows are the model's, and every committed app row belongs to
    its key's accepted finish, one per key (tests/stores/app_tx_machine.py)."""
    stats = run_app_transactions(kind, "short")
    assert stats["locked in"] and stats["committed"] and stats["rolled back"]


def test_redis_refuses_the_apps_transaction(redis_store_url: str) -> None:
    """Out of the model's app database: the Redis store is not in the app's database, and
    says so before any write (ConfigError)."""
    with open_store(redis_store_url) as store, sqlite3.connect(":memory:") as raw:
        lease = store.claim("k", owner="w1", ttl=30)
        assert lease is not None
        conn = app_connection(raw)
        conn.begin()
        for call in (lambda: store.lock_in(conn, lease, when="test"),
                     lambda: store.finish_in(conn, lease, "r"),
                     lambda: store.record_published_in(conn, "k2", task={"options": {}})):
            with pytest.raises(ConfigError):
                call()
        conn.rollback()
        record = store.get("k")
        assert record is not None and record.state is LeaseState.RUNNING
        assert store.get("k2") is None
