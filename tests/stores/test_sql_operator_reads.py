"""The SQL stores' operator reads (find by state, find of any state, stats) go through the
partial indexes of schema 7, never a scan of the table: at a million settled rows a table scan
took 0.45-0.7 s on SQLite (benchmarks/scale.py). The plans are read from the servers, and the
answers are checked against rows in every state."""

from __future__ import annotations

import sqlite3

from lease_celery import EffectState, LeaseState, Store, open_store
from lease_celery.stores import sqlite as sqlite_store
from lease_celery.stores.sql_glue import effect_find_query, find_query
from tests.support.servers import PG_DSN

STATES = [None, *LeaseState]

#: Receipts written past the store, so the planner plans for a table of them (statistics read
#: afresh): a busy store's, one in a thousand in the reconcile queue, one in a hundred in
#: flight, the rest done. ``{i}``: the row's number in the dialect's series.
RECEIPTS = 20_000
RECEIPT_STATE = ("CASE WHEN {i} % 1000 = 0 THEN 'needs_reconciliation' "
                 "WHEN {i} % 100 = 0 THEN 'in_flight' ELSE 'done' END")


def _fill(store: Store) -> None:
    """Two rows in each state, written through the library."""
    for i in range(2):
        for kind in ("ready", "done", "dead", "running"):
            lease = store.claim(f"{kind}{i}", owner="w", ttl=30)
            assert lease is not None
            if kind == "ready":
                assert store.release(lease)
            elif kind == "done":
                assert store.finish(lease, {"i": i})
            elif kind == "dead":
                assert store.kill(lease, reason="gave up")


def _check_answers(store: Store) -> None:
    _fill(store)
    for state in LeaseState:
        found = store.find(state=state, limit=10)
        assert sorted(r.key for r in found) == [f"{state.value}0", f"{state.value}1"], state
    newest = store.find(limit=3)
    everything = store.find(limit=100)
    assert len(everything) == 8
    times = [r.updated_at for r in everything]
    assert times == sorted(times, reverse=True)
    assert [r.key for r in newest] == [r.key for r in everything[:3]]
    assert {r.key for r in store.find(prefix="dead", limit=10)} == {"dead0", "dead1"}
    assert store.stats().counts == {"ready": 2, "running": 2, "done": 2, "dead": 2}


def _check_receipts(store: Store) -> None:
    """effects.find() of each state answers that state's receipts, newest first (two in each,
    written through the library)."""
    for i in range(2):
        for state in EffectState:
            key = f"{state.value}{i}"
            assert store.effect_insert(key, "f" * 64, None)
            receipt = store.effect_get(key)
            assert receipt is not None
            if state is not EffectState.IN_FLIGHT:
                assert store.effect_update(key, version=receipt.version, state=state,
                                           result=None)
    for state in EffectState:
        found = store.effects.find(state, limit=10)
        assert sorted(r.key for r in found) == [f"{state.value}0", f"{state.value}1"], state
        times = [r.updated_at for r in found]
        assert times == sorted(times, reverse=True), state
    assert len(store.effects.find(limit=100)) == 6


def test_sqlite_reads_use_the_partial_indexes_and_answer_right(tmp_path: object) -> None:
    path = f"{tmp_path}/reads.sqlite3"
    with open_store(f"sqlite:///{path}") as store:
        _check_answers(store)
    conn = sqlite3.connect(path)
    params = {"prefix": None, "owner": None, "limit": 20, "now": 0.0}
    for state in STATES:
        query = sqlite_store._Q[find_query(state)]
        steps = [row[3] for row in conn.execute("EXPLAIN QUERY PLAN " + query, params)]
        # Each read of the table goes through an index: a bare "SCAN lease_celery_leases" is
        # the whole table (what find() did before schema 7).
        reads = [step for step in steps if "lease_celery_leases" in step]
        assert reads and all("USING" in step for step in reads), (state, steps)
    steps = [row[3] for row in conn.execute("EXPLAIN QUERY PLAN " + sqlite_store._Q["stats"],
                                            params)]
    assert "SCAN lease_celery_leases" not in steps, steps
    assert any("COVERING INDEX lease_celery_leases_terminal" in step for step in steps), steps


def test_postgres_finds_use_the_partial_indexes_and_answer_right(postgres_url: str) -> None:
    import psycopg

    with open_store(postgres_url) as store:
        _check_answers(store)
        queries = store._q  # type: ignore[attr-defined]
    params = {"prefix": None, "owner": None, "limit": 20}
    with psycopg.connect(PG_DSN, autocommit=True) as conn:
        conn.execute("SET enable_seqscan = off")  # a tiny table: ask whether an index CAN serve
        for state in STATES:
            plan = "\n".join(row[0] for row in conn.execute(
                "EXPLAIN " + queries[find_query(state)], params))
            assert "Seq Scan" not in plan, (state, plan)
            assert "lease_celery_leases_" in plan, (state, plan)


def test_sqlite_effect_find_reads_a_range_of_the_state_index(tmp_path: object) -> None:
    """effects.find(state): that state's range of the receipts' state index (schema 8), in
    its order; before it, the whole table read and sorted."""
    path = f"{tmp_path}/receipts.sqlite3"
    with open_store(f"sqlite:///{path}") as store:
        _check_receipts(store)
    conn = sqlite3.connect(path)
    for state in EffectState:
        steps = [row[3] for row in conn.execute(
            "EXPLAIN QUERY PLAN " + sqlite_store._Q[effect_find_query(state)],
            {"state": state.value, "limit": 100})]
        # One step, and no "USE TEMP B-TREE FOR ORDER BY": the rows come in the index's order.
        assert steps == [
            "SEARCH lease_celery_effects USING INDEX lease_celery_effects_state (state=?)"], (
            state, steps)


def test_postgres_effect_find_reads_a_range_of_the_state_index(postgres_url: str) -> None:
    """effects.find(state) on a table of receipts: that state's range of the state index,
    read backwards (no sort), for the rare states and the common one alike."""
    import psycopg

    with open_store(postgres_url) as store:
        _check_receipts(store)
        queries = store._q  # type: ignore[attr-defined]
    table = f'"{postgres_url.split("schema=")[1]}".lease_celery_effects'
    with psycopg.connect(PG_DSN, autocommit=True) as conn:
        conn.execute(f"INSERT INTO {table} (key, fingerprint, state, started_at, attempts, "
                     f"version, updated_at) SELECT 'old:' || i, 'f', "
                     f"{RECEIPT_STATE.format(i='i')}, i, 1, 1, i "
                     f"FROM generate_series(1, {RECEIPTS}) AS i")
        conn.execute(f"ANALYZE {table}")
        for state in EffectState:
            plan = "\n".join(row[0] for row in conn.execute(
                "EXPLAIN " + queries[effect_find_query(state)],
                {"state": state.value, "limit": 100}))
            assert "Index Scan Backward using lease_celery_effects_state" in plan, (state, plan)
            assert "Sort" not in plan, (state, plan)
