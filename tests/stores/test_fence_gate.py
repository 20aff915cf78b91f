"""FenceGate and store-wide fences: the resource side of fencing, across keys.

The shared resource is a table in a SQL database of its own, on SQLite (a file apart from the
lease store) and on PostgreSQL (a schema of the test's own); the leases whose fences it orders
come from every store (``store_url``: SQLite, PostgreSQL, Redis) on an injected logical clock.
Every check of what was committed reads the resource through a separate connection.
"""

from __future__ import annotations

import sqlite3
import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from lease_celery import (
    ConfigError,
    FenceGate,
    Lease,
    LeaseLost,
    StaleFence,
    Store,
    open_store,
)
from lease_celery.testing import ManualClock
from tests.support.servers import PG_DSN, postgres_reachable, require
from tests.support.tokens import token_base

TTL = 10.0
RESOURCE = "reports-table"




@dataclass
class Resource:
    """A business table ``reports`` shared by the leases of many keys, in its own database."""

    kind: str
    connect: Callable[[], Any]
    table: str  # the reports table, qualified as the SQL needs it
    gate_table: str
    placeholder: str

    opened: list[Any] = field(default_factory=list)

    def gate(self) -> FenceGate:
        """A gate on a connection of its own (closed when the test ends)."""
        connection = self.connect()
        self.opened.append(connection)
        return FenceGate(connection, table=self.gate_table)

    def close(self) -> None:
        for connection in self.opened:
            connection.close()

    def insert(self, writer: str, fence: int) -> Callable[[Any], str]:
        """``fn`` for ``gate.write``: insert one row through the gate's connection."""
        def write(conn: Any) -> str:
            conn.execute(f"INSERT INTO {self.table} (writer, fence) VALUES "
                         f"({self.placeholder}, {self.placeholder})", (writer, fence))
            return writer

        return write

    def committed(self) -> list[tuple[str, int]]:
        """The rows another connection sees."""
        conn = self.connect()
        try:
            rows = conn.execute(f"SELECT writer, fence FROM {self.table} ORDER BY fence, writer")
            return [(str(writer), int(fence)) for writer, fence in rows.fetchall()]
        finally:
            conn.close()


def _sqlite_resource(tmp_path: Path) -> Iterator[Resource]:
    path = tmp_path / "resource.sqlite3"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE reports (writer TEXT NOT NULL, fence INTEGER NOT NULL)")
    conn.close()
    resource = Resource("sqlite", lambda: sqlite3.connect(path, timeout=10,
                                                          check_same_thread=False),
                        "reports", "lease_celery_fence_gate", "?")
    yield resource
    resource.close()


@contextmanager
def _postgres_resource() -> Iterator[Resource]:
    reachable, detail = postgres_reachable()
    require("PostgreSQL", reachable, detail)
    import psycopg

    schema = f"gate_test_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(PG_DSN, autocommit=True) as conn:
        conn.execute(f'CREATE SCHEMA "{schema}"')
        conn.execute(f"CREATE TABLE {schema}.reports (writer text NOT NULL, fence bigint NOT NULL)")
    try:
        # autocommit: every write() is its own transaction (see the default-mode test below for a
        # connection left in psycopg's default, non-autocommit mode).
        resource = Resource("postgres", lambda: psycopg.connect(PG_DSN, autocommit=True),
                            f"{schema}.reports", f"{schema}.fence_gate", "%s")
        yield resource
        resource.close()
    finally:
        with psycopg.connect(PG_DSN, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


@pytest.fixture(params=["sqlite", "postgres"])
def resource(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Resource]:
    """The shared resource: a table in a SQLite file, and in PostgreSQL."""
    if request.param == "sqlite":
        yield from _sqlite_resource(tmp_path)
    else:
        with _postgres_resource() as resource:
            yield resource


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(1_000.0)


def _claim(store: Store, key: str, owner: str) -> Lease:
    lease = store.claim(key, owner=owner, ttl=TTL)
    assert lease is not None, f"{owner} could not claim {key!r}"
    return lease


def _never(conn: Any) -> None:
    raise AssertionError("a stale writer's fn must not run")


# -- two generations of one key -----------------------------------------------------------


def test_stale_generation_is_refused_once_the_newer_one_has_written(
        stores: list[Store], resource: Resource, clock: ManualClock) -> None:
    """Generation 1 of ``job:42`` stalls, its lease expires and generation 2 takes over with a
    higher fence and writes. Generation 1's late write raises StaleFence (a LeaseLost), its
    ``fn`` never runs and nothing of it is committed; the resource's high-water mark is
    generation 2's fence."""
    old, new = stores
    first = _claim(old, "job:42", "worker-a")
    clock.now += TTL
    second = _claim(new, "job:42", "worker-b")
    base = token_base(old)
    assert (first.token, second.token) == (base + 1, base + 2)
    assert second.fence > first.fence > 0

    gate_new, gate_old = resource.gate(), resource.gate()
    assert gate_new.write(RESOURCE, second.fence, resource.insert("b", second.fence)) == "b"
    with pytest.raises(StaleFence, match=f"fence {first.fence} is stale") as excinfo:
        gate_old.write(RESOURCE, first.fence, _never)
    assert isinstance(excinfo.value, LeaseLost)
    assert resource.committed() == [("b", second.fence)]
    assert gate_old.highest(RESOURCE) == second.fence


def test_failed_write_commits_neither_its_rows_nor_its_fence(
        stores: list[Store], resource: Resource) -> None:
    """``fn`` raising rolls back the whole write: its rows and the raised high-water mark alike
    (they are one transaction), so an older fence is still accepted afterwards."""
    store = stores[0]
    low = _claim(store, "job:1", "worker-a")
    high = _claim(store, "job:2", "worker-b")
    gate = resource.gate()

    def half_written(conn: Any) -> None:
        resource.insert("b", high.fence)(conn)
        raise RuntimeError("crashed mid-write")

    with pytest.raises(RuntimeError, match="mid-write"):
        gate.write(RESOURCE, high.fence, half_written)
    assert resource.committed() == []
    assert gate.highest(RESOURCE) is None
    gate.write(RESOURCE, low.fence, resource.insert("a", low.fence))
    assert resource.committed() == [("a", low.fence)]


def test_failed_write_inside_the_callers_transaction_leaves_nothing(
        resource: Resource) -> None:
    """Inside a transaction the caller already has open, ``write`` is a nested unit: when
    ``fn`` raises, its rows and its fence are undone, although the caller goes on to commit
    its own work (as psycopg's nested savepoint does)."""
    fence = 7
    conn = resource.connect()
    resource.opened.append(conn)
    gate = FenceGate(conn, table=resource.gate_table)

    def half_written(c: Any) -> None:
        resource.insert("half", fence)(c)
        raise RuntimeError("crashed mid-write")

    if resource.kind == "sqlite":
        resource.insert("caller", 0)(conn)  # sqlite3 opens the caller's transaction here
        assert conn.in_transaction
        with pytest.raises(RuntimeError, match="mid-write"):
            gate.write(RESOURCE, fence, half_written)
        conn.commit()
    else:
        with conn.transaction():
            resource.insert("caller", 0)(conn)
            with pytest.raises(RuntimeError, match="mid-write"):
                gate.write(RESOURCE, fence, half_written)
    assert resource.committed() == [("caller", 0)]
    assert gate.highest(RESOURCE) is None


# -- leases of different keys -------------------------------------------------------------


def test_fences_order_leases_of_different_keys(
        stores: list[Store], resource: Resource) -> None:
    """Per-key tokens cannot be compared (both claims below have token 1); fences can: key B,
    claimed after key A, has the higher fence, and once B has written, A's write is refused
    although A's lease is still current and A.token == B.token == 1."""
    a_store, b_store = stores
    lease_a = _claim(a_store, "report:A", "worker-a")
    lease_b = _claim(b_store, "report:B", "worker-b")
    base = token_base(a_store)
    assert lease_a.token == lease_b.token == base + 1
    assert lease_b.fence > lease_a.fence

    resource.gate().write(RESOURCE, lease_b.fence, resource.insert("B", lease_b.fence))
    with pytest.raises(StaleFence):
        resource.gate().write(RESOURCE, lease_a.fence, _never)
    assert resource.committed() == [("B", lease_b.fence)]
    record = a_store.get("report:A")
    assert record is not None and (record.owner, record.token) == ("worker-a", base + 1)
    assert a_store.renew(lease_a, ttl=TTL) is not None  # the gate refused; the lease did not


def test_equal_fence_is_accepted_again(stores: list[Store], resource: Resource) -> None:
    """The holder of the highest fence may write as often as it needs: the same fence is
    accepted twice (``>=``, not ``>``), through one gate or two."""
    lease = _claim(stores[0], "job:42", "worker-a")
    gate = resource.gate()
    gate.write(RESOURCE, lease.fence, resource.insert("first", lease.fence))
    resource.gate().write(RESOURCE, lease.fence, resource.insert("second", lease.fence))
    assert resource.committed() == [("first", lease.fence), ("second", lease.fence)]
    assert gate.highest(RESOURCE) == lease.fence


def test_documented_limit_old_fence_before_any_newer_write_is_accepted(
        stores: list[Store], resource: Resource, clock: ManualClock) -> None:
    """The documented limit (lease_celery/fencing.py): the gate only remembers the highest
    fence it has *seen*. A superseded holder whose write arrives before any newer holder has
    written is accepted; it is refused only after a newer write. (If this test fails, the gate
    got stronger: update the docs.)"""
    old, new = stores
    first = _claim(old, "job:42", "worker-a")
    clock.now += TTL
    second = _claim(new, "job:42", "worker-b")  # first is superseded from here on
    gate = resource.gate()
    gate.write(RESOURCE, first.fence, resource.insert("stale-but-first", first.fence))
    gate.write(RESOURCE, second.fence, resource.insert("fresh", second.fence))
    with pytest.raises(StaleFence):
        gate.write(RESOURCE, first.fence, _never)
    assert resource.committed() == [("stale-but-first", first.fence), ("fresh", second.fence)]


def test_stale_writer_racing_an_open_newer_write_is_refused(
        stores: list[Store], resource: Resource) -> None:
    """The check and the write are one transaction that holds the resource's gate row: an
    older fence arriving while a newer write is still open waits for it, then is refused; it
    cannot slip in between the newer holder's check and its commit."""
    store = stores[0]
    older = _claim(store, "report:A", "worker-a")
    newer = _claim(store, "report:B", "worker-b")
    gate_new, gate_old = resource.gate(), resource.gate()
    inside, proceed = threading.Event(), threading.Event()
    outcome: dict[str, Any] = {}

    def slow_write(conn: Any) -> str:
        resource.insert("B", newer.fence)(conn)
        inside.set()
        assert proceed.wait(10)
        return "B"

    def stale_write() -> None:
        try:
            gate_old.write(RESOURCE, older.fence, resource.insert("A", older.fence))
            outcome["old"] = "committed"
        except StaleFence:
            outcome["old"] = "refused"

    writer = threading.Thread(target=lambda: gate_new.write(RESOURCE, newer.fence, slow_write))
    writer.start()
    assert inside.wait(10)
    racer = threading.Thread(target=stale_write)
    racer.start()
    racer.join(0.5)
    assert racer.is_alive(), "the stale write did not wait for the open newer write"
    proceed.set()
    writer.join(10)
    racer.join(10)
    assert outcome == {"old": "refused"}
    assert resource.committed() == [("B", newer.fence)]


def test_gate_refuses_fences_that_do_not_come_from_a_lease(resource: Resource) -> None:
    """A fence must be a positive int (a lease's ``fence``): 0, negatives, bools, strings and
    floats raise ConfigError and write nothing; a table name that is not a plain identifier is
    refused when the gate is made."""
    gate = resource.gate()
    for bad in (0, -1, True, "7", 7.0, None):
        with pytest.raises(ConfigError, match="fence must be a positive int"):
            gate.write(RESOURCE, bad, _never)  # type: ignore[arg-type]
    assert gate.highest(RESOURCE) is None
    with pytest.raises(ConfigError, match="plain identifier"):
        FenceGate(resource.connect(), table="gate; DROP TABLE reports")


def test_highest_then_write_commits_on_a_default_mode_psycopg_connection() -> None:
    """On a psycopg connection in its default (non-autocommit) mode, a ``write`` made after
    ``highest`` was read on the same connection is committed: another connection sees it."""
    import psycopg

    with _postgres_resource() as resource:
        conn = psycopg.connect(PG_DSN)  # psycopg's default: autocommit off
        try:
            gate = FenceGate(conn, table=resource.gate_table)
            gate.write(RESOURCE, 1, resource.insert("one", 1))
            assert gate.highest(RESOURCE) == 1
            gate.write(RESOURCE, 2, resource.insert("two", 2))
            assert resource.committed() == [("one", 1), ("two", 2)]
        finally:
            conn.close()  # before the schema is dropped: an open transaction would block it


# -- store-wide fences --------------------------------------------------------------------


def test_fences_grow_across_keys_takeovers_purges_and_store_objects(
        stores: list[Store], clock: ManualClock) -> None:
    """Every successful claim, on any key and through any store object, takes a fence higher
    than every earlier one: new keys, a re-claim after release, a takeover after expiry, and a
    key purged and claimed again (whose token continues, while its fence jumps past all others).
    The row's recorded fence is the lease's; a refused claim takes none."""
    a, b = stores
    fences: list[int] = []

    def claimed(store: Store, key: str, owner: str) -> Lease:
        lease = _claim(store, key, owner)
        record = store.get(key)
        assert record is not None and record.fence == lease.fence
        fences.append(lease.fence)
        return lease

    k1 = claimed(a, "k1", "w1")
    claimed(b, "k2", "w2")
    assert a.claim("k1", owner="w3", ttl=TTL) is None  # refused: k1 is held
    assert a.finish(k1, "done") and a.purge("k1")
    claimed(b, "k3", "w3")
    again = claimed(a, "k1", "w4")  # purged and re-created
    assert again.token == token_base(a) + 2
    assert b.release(again)
    claimed(b, "k1", "w5")  # after a release
    clock.now += TTL
    claimed(a, "k1", "w6")  # a takeover after expiry
    for key in ("k2", "k3"):
        assert a.purge(key)
    claimed(b, "k4", "w7")  # every other row gone
    assert fences == sorted(set(fences)), f"fences did not strictly grow: {fences}"


def test_concurrent_claims_on_different_keys_get_distinct_fences(store_url: str) -> None:
    """Claims racing on many keys from many threads (a store object each) never share a fence,
    and renewals keep a lease's fence."""
    per_thread, threads = 10, 6
    fences: list[int] = []
    lock = threading.Lock()
    errors: list[BaseException] = []

    def claimer(index: int) -> None:
        try:
            with open_store(store_url) as store:
                for n in range(per_thread):
                    lease = store.claim(f"t{index}:{n}", owner=f"w{index}", ttl=30)
                    assert lease is not None
                    renewed = store.renew(lease, ttl=30)
                    assert renewed is not None and renewed.fence == lease.fence
                    with lock:
                        fences.append(lease.fence)
        except BaseException as exc:
            errors.append(exc)

    workers = [threading.Thread(target=claimer, args=(i,)) for i in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(30)
    assert not errors, errors
    assert len(fences) == len(set(fences)) == per_thread * threads
