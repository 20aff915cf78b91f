"""InnoDB's locking traps, each met by the MySQL store on purpose (MariaDB in the suite).

- Gap and next-key locks: under InnoDB's default REPEATABLE READ a locking range read (a
  sweep's) also locks the gaps between rows, and an insert into one (a claim of a new key)
  waits for it. The store's sessions run READ COMMITTED: no gap locks.
- Deadlocks: InnoDB breaks a cycle by rolling one transaction back (error 1213); the store
  runs it again, within ``reconnect_timeout``; a lock it cannot get in that time is an error
  naming the lock wait.
- ``SKIP LOCKED``: a sweep passes over a row another transaction holds instead of waiting.
- ``INSERT ... ON DUPLICATE KEY UPDATE``: its SET list runs left to right, each assignment
  seeing those before it; the claim takes its verdict first, and a refused claim changes no
  column. Affected rows count matched rows (a renewal on a clock that has not moved).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import closing
from typing import Any

import pytest

from lease_celery import LeaseState, Store, StoreError, open_store
from lease_celery.testing import ManualClock
from tests.support.mysql_databases import server_connection

TASK = {"task": "t", "args": [], "kwargs": {}, "options": {"task_id": "id-1"}}


@pytest.fixture
def store(mysql_url: str, clock: ManualClock) -> Iterator[Store]:
    with open_store(mysql_url, clock=clock) as opened:
        opened.get("warm-up")  # the schema
        yield opened


def _database(store: Store) -> str:
    name: str = store.database  # type: ignore[attr-defined]
    return name


def _raw(store: Store, isolation: str = "READ COMMITTED") -> Any:
    """A connection of the test's own to the store's database, as an application's."""
    conn = server_connection()
    with conn.cursor() as cur:
        cur.execute(f"USE `{_database(store)}`")
        cur.execute(f"SET SESSION TRANSACTION ISOLATION LEVEL {isolation}")
        cur.execute("SET SESSION innodb_lock_wait_timeout = 20")
    return conn


def test_sessions_run_read_committed_on_utc(store: Store) -> None:
    """The store's own sessions (fenced() yields one) read committed, in UTC, whatever the
    server's defaults (MariaDB's: REPEATABLE READ, the system zone)."""
    lease = store.claim("k", owner="w", ttl=30)
    assert lease is not None
    with store.fenced(lease) as conn, conn.cursor() as cur:
        cur.execute("SELECT @@tx_isolation AS level, @@time_zone AS zone")
        row = cur.fetchone()
    assert (row["level"], row["zone"]) == ("READ-COMMITTED", "+00:00")


def test_claims_racing_for_one_missing_key_give_one_lease_and_no_error(
        mysql_url: str, clock: ManualClock) -> None:
    """Eight stores claim the same absent keys at once (each key a new row: the insert path,
    where REPEATABLE READ's next-key locks make two inserts deadlock): every key is won by
    exactly one claim, the others are refused, and no claim raises."""
    stores = [open_store(mysql_url, clock=clock) for _ in range(8)]
    stores[0].get("warm-up")
    won: dict[str, list[str]] = {}
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(stores))

    def claim_all(index: int, store: Store) -> None:
        for n in range(15):
            barrier.wait()
            try:
                lease = store.claim(f"race:{n}", owner=f"w{index}", ttl=30)
            except BaseException as exc:
                errors.append(exc)
                continue
            if lease is not None:
                won.setdefault(lease.key, []).append(lease.owner)

    threads = [threading.Thread(target=claim_all, args=(i, s)) for i, s in enumerate(stores)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    for store in stores:
        store.close()
    assert not errors, errors
    assert sorted(won) == sorted(f"race:{n}" for n in range(15))
    assert all(len(owners) == 1 for owners in won.values()), won


def test_a_range_lock_does_not_block_a_claim_of_a_new_key_but_would_under_repeatable_read(
        store: Store, mysql_url: str, clock: ManualClock) -> None:
    """A transaction holding a sweep's locking range read (rows due up to far in the future)
    on a store session does not hold the gaps: a claim of a new key, whose row falls in that
    range, goes through at once. The same read in a REPEATABLE READ session (an application's
    transaction on the same tables, at the server's default) locks the gaps, and the claim
    waits: the store then reports the lock wait, by its timeout, naming it."""
    for n in range(3):
        assert store.claim(f"due:{n}", owner="w", ttl=30, task=TASK) is not None
    range_read = ("SELECT `key` FROM lease_celery_leases WHERE sweep_at IS NOT NULL "
                  "AND sweep_at <= 1e12 FOR UPDATE")
    for isolation, blocked in (("READ COMMITTED", False), ("REPEATABLE READ", True)):
        holder = _raw(store, isolation)
        try:
            holder.begin()
            with holder.cursor() as cur:
                cur.execute(range_read)
            url = f"{mysql_url}?lock_wait_timeout=1&reconnect_timeout=0.5"
            with open_store(url, clock=clock) as other:
                started = time.monotonic()
                if blocked:
                    with pytest.raises(StoreError, match="Lock wait timeout"):
                        other.claim(f"new:{isolation}", owner="w2", ttl=30, task=TASK)
                else:
                    assert other.claim(f"new:{isolation}", owner="w2", ttl=30,
                                       task=TASK) is not None
                    assert time.monotonic() - started < 1.0
        finally:
            holder.rollback()
            holder.close()


def test_a_sweep_skips_a_row_another_transaction_holds(store: Store,
                                                       clock: ManualClock) -> None:
    """Two expired leases; another transaction holds one row. The sweep returns the other at
    once (SKIP LOCKED, no wait), and the held one on the next sweep after the holder ends."""
    for key in ("held", "free"):
        assert store.claim(key, owner="w", ttl=5, task=TASK) is not None
    clock.advance(10)
    holder = _raw(store)
    try:
        holder.begin()
        with holder.cursor() as cur:
            cur.execute("SELECT token FROM lease_celery_leases WHERE `key` = 'held' FOR UPDATE")
        started = time.monotonic()
        assert [r.key for r in store.sweep_expired(limit=10, grace=1)] == ["free"]
        assert time.monotonic() - started < 1.0
    finally:
        holder.rollback()
        holder.close()
    assert [r.key for r in store.sweep_expired(limit=10, grace=1)] == ["held"]


def test_a_deadlock_is_run_again_and_the_operation_succeeds(
        store: Store, caplog: pytest.LogCaptureFixture) -> None:
    """The store's renewal holds row a and waits for row b; another transaction, which holds
    b (and has written enough that InnoDB keeps it), then asks for a: a deadlock. InnoDB rolls
    the renewal back (1213); the store runs it again once b is free, and both leases renew."""
    a = store.claim("a", owner="w", ttl=30)
    b = store.claim("b", owner="w", ttl=30)
    assert a is not None and b is not None
    holder = _raw(store)
    answer: list[Any] = []
    try:
        holder.begin()
        with holder.cursor() as cur:
            # Heavier than the renewal: InnoDB rolls back the transaction that wrote less.
            cur.execute("CREATE TEMPORARY TABLE weight (n INT) ENGINE = InnoDB")
            cur.execute("INSERT INTO weight SELECT seq FROM seq_1_to_2000")
            cur.execute("UPDATE lease_celery_leases SET reason = 'x' WHERE `key` = 'b'")
        renewing = threading.Thread(target=lambda: answer.append(
            store.renew_many([a, b], ttl=60)))
        with caplog.at_level(logging.WARNING, logger="lease_celery.stores.mysql"):
            renewing.start()
            time.sleep(0.5)  # the renewal holds a and waits for b
            with holder.cursor() as cur:
                cur.execute("UPDATE lease_celery_leases SET reason = 'y' WHERE `key` = 'a'")
            holder.commit()
            renewing.join(20)
    finally:
        holder.close()
    assert answer and all(lease is not None for lease in answer[0]), answer
    assert any("Deadlock" in record.getMessage() for record in caplog.records), caplog.text


def test_a_lock_held_past_the_bound_is_an_error_naming_it(store: Store, mysql_url: str,
                                                          clock: ManualClock) -> None:
    """A row held by another transaction for longer than the store waits (lock_wait_timeout,
    tried again until reconnect_timeout): the finish raises StoreError naming the lock wait,
    within the bound, and the row is unchanged."""
    lease = store.claim("k", owner="w", ttl=30)
    assert lease is not None
    holder = _raw(store)
    try:
        holder.begin()
        with holder.cursor() as cur:
            cur.execute("SELECT token FROM lease_celery_leases WHERE `key` = 'k' FOR UPDATE")
        with open_store(f"{mysql_url}?lock_wait_timeout=1&reconnect_timeout=1.5",
                        clock=clock) as other:
            started = time.monotonic()
            with pytest.raises(StoreError, match="Lock wait timeout"):
                other.finish(lease, "late")
            assert time.monotonic() - started < 5
    finally:
        holder.rollback()
        holder.close()
    record = store.get("k")
    assert record is not None and record.state is LeaseState.RUNNING


def test_a_refused_claim_changes_no_column(store: Store, clock: ManualClock) -> None:
    """A claim of a held key goes through ON DUPLICATE KEY UPDATE and is refused: the row is
    exactly as it was (no column moved, nonce and history included)."""
    assert store.claim("k", owner="w1", ttl=30, task=TASK) is not None
    columns = "*"
    with closing(server_connection()) as conn, conn.cursor() as cur:
        cur.execute(f"SELECT {columns} FROM `{_database(store)}`.lease_celery_leases")
        before = cur.fetchall()
        clock.advance(1)
        assert store.claim("k", owner="w2", ttl=30) is None
        cur.execute(f"SELECT {columns} FROM `{_database(store)}`.lease_celery_leases")
        assert cur.fetchall() == before
    assert [e.event for e in store.history("k")] == ["claimed"]


def test_a_takeover_is_judged_on_the_row_as_it_was(store: Store, clock: ManualClock) -> None:
    """The upsert's SET list runs left to right: a takeover of an expired lease counts the
    takeover and one attempt more from the row before the claim (state running), not from
    the state the claim has just written."""
    first = store.claim("k", owner="w1", ttl=5)
    assert first is not None
    clock.advance(5)  # the boundary instant counts as expired
    second = store.claim("k", owner="w2", ttl=5)
    assert second is not None
    assert (second.token, second.takeovers, second.attempts) == (2, 1, 2)
    assert [e.event for e in store.history("k")] == ["claimed", "taken_over"]


def test_a_renewal_on_a_clock_that_has_not_moved_is_a_renewal(store: Store) -> None:
    """MySQL counts changed rows unless asked for matched ones (CLIENT_FOUND_ROWS): a renewal
    that sets the same deadline (the clock did not move) still matched, and renews."""
    lease = store.claim("k", owner="w", ttl=30)
    assert lease is not None
    assert store.renew(lease, ttl=30) is not None
    assert store.renew(lease, ttl=30) is not None
    assert store.checkpoint(lease, "same") and store.checkpoint(lease, "same")


def test_keys_compare_byte_for_byte(store: Store) -> None:
    """A binary, no-pad collation: 'k', 'k ' and 'K' are three keys, and so are the two
    spellings of é (a PAD SPACE, case- or accent-insensitive collation would merge them)."""
    keys = ("k", "k ", "K", "\u00e9", "e\u0301")
    for key in keys:
        assert store.claim(key, owner="w", ttl=30) is not None, key
    assert {r.key for r in store.find(limit=10)} == set(keys)


def test_a_claim_resent_after_its_lease_expired_hands_out_one_token(
        store: Store, clock: ManualClock, monkeypatch: pytest.MonkeyPatch) -> None:
    """The claim commits, the reply to its COMMIT is lost, and the store's second try comes
    after the lease expired (a server restart longer than the ttl; the chaos harness's full
    run met it). The second try finds the first's nonce on the row and answers that lease,
    token 1, instead of taking over its own row: one call, one token, one history entry."""
    import pymysql

    from lease_celery.stores import mysql as mysql_store

    real = mysql_store._claim_in
    lost: list[bool] = []

    def reply_lost(conn: Any, queries: dict[str, str], params: dict[str, Any]) -> Any:
        row = real(conn, queries, params)
        if not lost:
            conn.commit()  # it committed; then its connection died before the answer came
            lost.append(True)
            clock.advance(30)  # the first send's lease (ttl 5) has expired by the re-send
            raise pymysql.err.OperationalError(2013, "Lost connection (test)")
        return row

    monkeypatch.setattr(mysql_store, "_claim_in", reply_lost)
    lease = store.claim("k", owner="w", ttl=5)
    assert lost and lease is not None
    assert (lease.token, lease.expires_at) == (1, 105.0)
    assert [e.event for e in store.history("k")] == ["claimed"]
