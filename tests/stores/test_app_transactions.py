"""The lease's writes in the app's own transaction (``Store.lock_in``, ``finish_in``,
``record_published_in``), through every form of app connection, on every SQL store.

The rule under test: the app's rows and the lease's write commit together or not at all, the
lease is checked under its row's lock when the transaction starts and again by the finish,
and a connection that does not reach the store's own database is refused before any write.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from lease_celery import ConfigError, LeaseLost, LeaseState, Store, open_store
from lease_celery.app_connections import app_connection
from lease_celery.testing import ManualClock
from tests.support import app_db
from tests.support.tokens import token_base

SQL_STORES = ["sqlite", "postgres", "mysql"]


@pytest.fixture(params=SQL_STORES)
def sql_store_url(request: pytest.FixtureRequest) -> str:
    from tests.conftest import fresh_store_url

    return fresh_store_url(request, request.param)


@pytest.fixture
def store(sql_store_url: str, clock: ManualClock) -> Iterator[Store]:
    with open_store(sql_store_url, clock=clock) as opened:
        yield opened


@pytest.fixture(params=app_db.KINDS)
def app(request: pytest.FixtureRequest, store: Store) -> Iterator[Any]:
    conn = app_db.connect(store, request.param)
    yield conn
    app_db.close(conn)


def _in_transaction(conn: Any) -> Any:
    wrapped = app_connection(conn)
    wrapped.begin()
    return wrapped


def test_the_finish_commits_with_the_apps_rows(store: Store, app: Any) -> None:
    lease = store.claim("pay:1", owner="w1", ttl=30)
    assert lease is not None
    tx = _in_transaction(app)
    store.lock_in(tx, lease, when="at the start")
    app_db.insert(app, store, "pay:1")
    assert store.finish_in(tx, lease, {"paid": 1}) is True
    assert store.get("pay:1").state is LeaseState.RUNNING  # not committed: not seen
    tx.commit()
    record = store.get("pay:1")
    assert (record.state, record.result, record.token) == (LeaseState.DONE, {"paid": 1},
                                                          lease.token)
    assert app_db.rows(store, "pay:1") == [1]
    assert "finished" in [entry.event for entry in store.history("pay:1")]


def test_a_rollback_takes_the_finish_and_the_rows_back(store: Store, app: Any) -> None:
    lease = store.claim("pay:2", owner="w1", ttl=30)
    assert lease is not None
    tx = _in_transaction(app)
    store.lock_in(tx, lease, when="at the start")
    app_db.insert(app, store, "pay:2")
    assert store.finish_in(tx, lease, "ok", settle_within=10) is True
    tx.rollback()
    record = store.get("pay:2")
    assert (record.state, record.owner, record.token) == (LeaseState.RUNNING, "w1",
                                                         lease.token)
    assert app_db.rows(store, "pay:2") == []
    assert store.finish(lease, "later") is True  # the lease still holds: nothing was lost


def test_a_stale_lease_is_refused_at_the_start_and_at_the_finish(
        store: Store, app: Any, clock: ManualClock) -> None:
    old = store.claim("pay:3", owner="w1", ttl=5)
    assert old is not None
    clock.advance(6)
    new = store.claim("pay:3", owner="w2", ttl=30)
    assert new is not None and new.token == old.token + 1
    tx = _in_transaction(app)
    with pytest.raises(LeaseLost, match="not current at the start"):
        store.lock_in(tx, old, when="at the start")
    assert store.finish_in(tx, old, "stale") is False
    tx.rollback()
    assert store.get("pay:3").owner == "w2"


def test_the_lock_holds_a_takeover_off_until_the_transaction_ends(
        sql_store_url: str, store: Store, clock: ManualClock) -> None:
    """Checked current under the row's lock, the lease expires (on the store's clock) while
    the app's transaction is open: another worker's claim waits for that transaction, and the
    finish, fenced again, is refused; the rollback lets the claim through."""
    lease = store.claim("pay:4", owner="w1", ttl=5)
    assert lease is not None
    conn = app_db.connect(store, "driver")
    other = open_store(sql_store_url, clock=clock)
    try:
        tx = _in_transaction(conn)
        store.lock_in(tx, lease, when="at the start")
        clock.advance(6)
        claimed: list[Any] = []
        thread = threading.Thread(target=lambda: claimed.append(
            other.claim("pay:4", owner="w2", ttl=30)))
        thread.start()
        time.sleep(0.5)
        assert claimed == []  # waiting for the app's transaction
        assert store.finish_in(tx, lease, "late") is False
        tx.rollback()
        thread.join(timeout=20)
        assert claimed and claimed[0] is not None and claimed[0].token == lease.token + 1
    finally:
        other.close()
        conn.close()


def test_the_outbox_row_exists_only_if_the_transaction_commits(store: Store, app: Any) -> None:
    info = {"task": "shop.pay", "id": "t-1", "args": [5], "kwargs": {},
            "options": {"task_id": "t-1"}}
    tx = _in_transaction(app)
    assert store.record_published_in(tx, "order:5", task=info) is True
    tx.rollback()
    assert store.get("order:5") is None
    tx = _in_transaction(app)
    assert store.record_published_in(tx, "order:5", task=info, countdown=3) is True
    tx.commit()
    record = store.get("order:5")
    assert (record.state, record.task_id, record.attempts) == (LeaseState.READY, "t-1", 0)
    lease = store.claim("order:5", owner="w1", ttl=30)
    assert lease is not None and lease.token == token_base(store) + 1


def test_a_connection_to_another_database_is_refused(store: Store, tmp_path: Any) -> None:
    lease = store.claim("pay:6", owner="w1", ttl=30)
    assert lease is not None
    if app_db.dialect(store) == "sqlite":
        import sqlite3

        elsewhere: Any = sqlite3.connect(tmp_path / "elsewhere.sqlite3")
    elif app_db.dialect(store) == "mysql":
        from tests.support.mysql_databases import server_connection

        elsewhere = server_connection()  # the server's, but no database of the store's
        elsewhere.select_db("test")
    else:
        import psycopg

        from tests.support.servers import PG_DSN
        elsewhere = psycopg.connect(PG_DSN.rsplit("/", 1)[0] + "/postgres")
    try:
        tx = _in_transaction(elsewhere)
        with pytest.raises(ConfigError, match="its own"):
            store.lock_in(tx, lease, when="at the start")
        with pytest.raises(ConfigError, match="its own"):
            store.finish_in(tx, lease, "x")
        tx.rollback()
    finally:
        elsewhere.close()
    assert store.get("pay:6").state is LeaseState.RUNNING


def test_a_store_outside_the_apps_database_says_so(redis_store_url: str) -> None:
    import sqlite3

    with open_store(redis_store_url) as redis_store:
        lease = redis_store.claim("pay:7", owner="w1", ttl=30)
        assert lease is not None
        tx = app_connection(sqlite3.connect(":memory:"))
        with pytest.raises(ConfigError, match="not in your database"):
            redis_store.finish_in(tx, lease, "x")


def test_an_object_that_is_no_connection_is_named() -> None:
    with pytest.raises(ConfigError, match=r"cannot write through a builtins\.dict"):
        app_connection({})


def test_unique_enqueues_in_a_transaction_hand_back_the_keys_holder(sql_store_url: str) -> None:
    """``lease_unique`` for an enqueue in a transaction, as for any publish: a second enqueue
    of the key, in the same transaction or after it committed, gets the first's AsyncResult
    and holds no message of its own; the key has one row."""
    from celery import Celery

    import lease_celery
    from lease_celery import LeasedTask

    app = Celery("unique_tx", broker="memory://", backend="cache+memory://",
                 set_as_current=False)
    app.conf.update(lease_store_url=sql_store_url)

    @app.task(base=LeasedTask, bind=True, lease_key="order:{n}", lease_unique=True,
              shared=False)
    def pay(self: LeasedTask, n: int) -> None:
        raise AssertionError("not run here")

    with open_store(sql_store_url) as store:
        conn = app_db.connect(store, "driver")
        try:
            with lease_celery.transaction(conn):
                first = pay.apply_async((1,), lease_transaction=conn)
                again = pay.apply_async((1,), lease_transaction=conn)
                assert again.id == first.id
            with lease_celery.transaction(conn):
                later = pay.apply_async((1,), lease_transaction=conn)
            assert later.id == first.id
        finally:
            conn.close()
        record = store.get("order:1")
        assert (record.state, record.task_id) == (LeaseState.READY, first.id)
