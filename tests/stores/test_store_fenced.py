"""store.fenced(lease): the caller's own writes commit only while the lease is current.

PostgreSQL and SQLite run the caller's writes in a transaction on the store's own database
(PostgreSQL: a table in the store's schema; SQLite: a table in the same file) and check the
fencing predicate before the block and again at commit. Redis has no such transaction and says
so. Expiry is driven by an injected logical clock.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import closing
from typing import Any

import psycopg
import pytest

from lease_celery import Lease, LeaseLost, LeaseState, Store, StoreError, open_store
from lease_celery.stores.sqlite import SQLiteStore
from lease_celery.testing import ManualClock
from tests.support.servers import PG_DSN

TTL = 10.0




class Business:
    """The caller's own table ``reports(key, value)`` in the store's database, read past the
    store (a connection of its own, so it sees only committed rows)."""

    def __init__(self, store: Store) -> None:
        self.store = store
        if isinstance(store, SQLiteStore):
            self.table = "reports"
            self.param = "?"
            with closing(sqlite3.connect(store.path)) as conn, conn:
                conn.execute("CREATE TABLE reports (key TEXT PRIMARY KEY, value TEXT)")
        else:
            self.table = f'"{store.schema}".reports'  # type: ignore[attr-defined]
            self.param = "%s"
            with psycopg.connect(PG_DSN, autocommit=True) as conn:
                conn.execute(f'CREATE SCHEMA IF NOT EXISTS "{store.schema}"')  # type: ignore[attr-defined]
                conn.execute(f"CREATE TABLE {self.table} (key text PRIMARY KEY, value text)")

    def insert(self, conn: Any, key: str, value: str) -> None:
        """Write through the connection ``fenced`` yielded."""
        conn.execute(f"INSERT INTO {self.table} (key, value) VALUES ({self.param}, {self.param})",
                     (key, value))

    def rows(self) -> dict[str, str]:
        if isinstance(self.store, SQLiteStore):
            with closing(sqlite3.connect(self.store.path)) as conn:
                return dict(conn.execute(f"SELECT key, value FROM {self.table}").fetchall())
        with psycopg.connect(PG_DSN) as conn:
            return dict(conn.execute(f"SELECT key, value FROM {self.table}").fetchall())


@pytest.fixture(params=["sqlite", "postgres"])
def fenced_url(request: pytest.FixtureRequest) -> str:
    """The stores that offer fenced transactions."""
    url: str = request.getfixturevalue(f"{request.param}_url")
    return url


@pytest.fixture
def stores(fenced_url: str, clock: ManualClock) -> Iterator[list[Store]]:
    opened = [open_store(fenced_url, clock=clock), open_store(fenced_url, clock=clock)]
    opened[0].get("warm-up")  # creates the store's tables (and PostgreSQL schema)
    yield opened
    for store in opened:
        store.close()


@pytest.fixture
def business(stores: list[Store]) -> Business:
    return Business(stores[0])


def test_current_owner_fenced_write_commits(stores: list[Store], business: Business) -> None:
    """The current holder's write through fenced() commits when the block ends (another
    connection sees it), the lease row is untouched by the fenced block, and the lease can
    still finish afterwards."""
    a, _ = stores
    lease = a.claim("report:1", owner="worker-a", ttl=TTL)
    assert lease is not None
    before = a.get("report:1")
    with a.fenced(lease) as conn:
        business.insert(conn, "report:1", "written by token 1")
    assert business.rows() == {"report:1": "written by token 1"}
    assert a.get("report:1") == before
    assert a.finish(lease, "ok") is True


def _stale_block(store: Store, lease: Lease, business: Business) -> None:
    """Try a fenced write with ``lease`` (refused before the block or at its exit: either way
    LeaseLost naming the lease's key and token)."""
    with pytest.raises(LeaseLost, match=r"not current") as excinfo, store.fenced(lease) as conn:
        business.insert(conn, lease.key, f"stale token {lease.token}")
    assert repr(lease.key) in str(excinfo.value)
    assert f"token {lease.token}" in str(excinfo.value)


def test_expired_owner_fenced_write_is_refused(
    stores: list[Store], business: Business, clock: ManualClock
) -> None:
    """A lease at or past its deadline (nobody took over yet): fenced() raises LeaseLost naming
    the lease, the caller's write is not committed, and the lease row is unchanged."""
    a, _ = stores
    lease = a.claim("report:2", owner="worker-a", ttl=TTL)
    assert lease is not None
    before = a.get("report:2")
    for now in (lease.expires_at, lease.expires_at + 50):
        clock.now = now
        _stale_block(a, lease, business)
        assert business.rows() == {}
        assert a.get("report:2") == before


def test_taken_over_owner_fenced_write_is_refused_and_the_new_owner_commits(
    stores: list[Store], business: Business, clock: ManualClock
) -> None:
    """After expiry and takeover, the old holder's fenced() raises LeaseLost and commits
    nothing; the new holder's fenced write commits; the old holder is refused again
    afterwards and the table holds only the new holder's row."""
    a, b = stores
    old = a.claim("report:3", owner="worker-a", ttl=TTL)
    assert old is not None
    clock.now = old.expires_at
    new = b.claim("report:3", owner="worker-b", ttl=TTL)
    assert new is not None and new.token == old.token + 1
    _stale_block(a, old, business)
    assert business.rows() == {}
    with b.fenced(new) as conn:
        business.insert(conn, "report:3", "fresh")
    _stale_block(a, old, business)
    assert business.rows() == {"report:3": "fresh"}
    record = b.get("report:3")
    assert record is not None and (record.owner, record.token) == ("worker-b", 2)


def test_lease_expiring_inside_the_block_commits_nothing(
    stores: list[Store], business: Business, clock: ManualClock
) -> None:
    """A lease current when the block starts but expired when it ends (the clock reaches the
    deadline inside the block): LeaseLost is raised at exit, the write made inside the block
    is rolled back, and afterwards another owner can take the key."""
    a, b = stores
    lease = a.claim("report:4", owner="worker-a", ttl=TTL)
    assert lease is not None
    ran: list[str] = []
    with pytest.raises(LeaseLost, match=r"at commit"), a.fenced(lease) as conn:
        business.insert(conn, "report:4", "written while current")
        ran.append("inserted")
        clock.now = lease.expires_at
    assert ran == ["inserted"]
    assert business.rows() == {}
    taken = b.claim("report:4", owner="worker-b", ttl=TTL)
    assert taken is not None and taken.token == lease.token + 1


def test_error_inside_the_block_rolls_back_and_propagates(
    stores: list[Store], business: Business
) -> None:
    """An exception raised by the caller's block propagates unchanged (not turned into
    LeaseLost or StoreError) and the block's writes are rolled back; the lease stays current."""
    a, _ = stores
    lease = a.claim("report:5", owner="worker-a", ttl=TTL)
    assert lease is not None
    with pytest.raises(KeyError, match="boom"), a.fenced(lease) as conn:
        business.insert(conn, "report:5", "half done")
        raise KeyError("boom")
    assert business.rows() == {}
    record = a.get("report:5")
    assert record is not None and record.state is LeaseState.RUNNING
    with a.fenced(lease) as conn:
        business.insert(conn, "report:5", "done")
    assert business.rows() == {"report:5": "done"}


@pytest.mark.parametrize("store_url", ["redis"], indirect=True)
def test_redis_store_does_not_offer_fenced_writes(store_url: str) -> None:
    """Redis cannot run the caller's writes in the lease's transaction: fenced() raises
    StoreError saying so and pointing to the PostgreSQL and SQLite stores; the lease is
    unaffected and still finishes."""
    with open_store(store_url) as store:
        lease = store.claim("report:6", owner="worker-a", ttl=TTL)
        assert lease is not None
        with (pytest.raises(StoreError, match=r"cannot run your writes.*PostgreSQL or SQLite"),
              store.fenced(lease)):
            pytest.fail("the block must not run")
        assert store.finish(lease, "ok") is True
