"""The MySQL store's sweeps, retention and operator reads go through indexes, never a scan of
the table, as the other SQL stores' (tests/stores/test_sql_operator_reads.py). MySQL has no
partial index: the (state, updated_at) index serves find() and stats() one state at a time,
sweep_at's the sweep, and generated columns stand in for the partial ones (terminal_at:
settled done/dead rows, which retention reads oldest first). The plans are read from the
server (EXPLAIN) on a table of mostly settled rows, as a busy store's is; the answers are
checked on rows in every state (docs/proof.md: the same plans, and their times, at a million)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from lease_celery import EffectState, LeaseState, Store, open_store
from lease_celery.stores.sql_glue import effect_find_query, find_query
from tests.stores.test_sql_operator_reads import (
    RECEIPT_STATE,
    RECEIPTS,
    STATES,
    _check_answers,
    _check_receipts,
)
from tests.support.mysql_databases import server_connection

#: Settled rows written past the store (the sequence engine: ~0.1 s), so the optimizer plans
#: for a table of them.
SETTLED = 20_000


@pytest.fixture
def store(mysql_url: str) -> Iterator[Store]:
    with open_store(mysql_url) as opened:
        _check_answers(opened)
        yield opened


@pytest.fixture
def settled(store: Store) -> Store:
    """The store, with SETTLED old done rows beside _check_answers' (the optimizer's
    statistics read afresh)."""
    _write_past(store, "lease_celery_leases",
                "INSERT INTO lease_celery_leases (`key`, state, owner, token, expires_at, "
                "updated_at, result) SELECT CONCAT('old:', seq), 'done', 'w', 1, seq, seq, '1' "
                f"FROM seq_1_to_{SETTLED}")
    return store


def _write_past(store: Store, table: str, insert: str) -> None:
    """``insert`` run on the store's database, past the store, and the optimizer's statistics
    of ``table`` read afresh."""
    conn = server_connection()
    try:
        with conn.cursor() as cur:
            cur.execute(f"USE `{store.database}`")  # type: ignore[attr-defined]
            cur.execute(insert)
            cur.execute(f"ANALYZE TABLE {table}")
            cur.fetchall()
    finally:
        conn.close()


def _explain(store: Store, query: str, params: dict[str, Any]) -> list[dict[str, Any]]:
    conn = server_connection()
    try:
        with conn.cursor() as cur:
            cur.execute(f"USE `{store.database}`")  # type: ignore[attr-defined]
            cur.execute("EXPLAIN " + query, params)
            names = [d[0] for d in cur.description]
            return [dict(zip(names, row, strict=True)) for row in cur.fetchall()]
    finally:
        conn.close()


def _uses_indexes(plan: list[dict[str, Any]]) -> bool:
    """Every read of the leases table goes through an index (no type ALL: a full scan)."""
    reads = [step for step in plan if str(step["table"]).startswith("lease_celery_leases")]
    return bool(reads) and all(step["type"] != "ALL" and step["key"] for step in reads)


def test_find_reads_use_the_state_index_and_answer_right(settled: Store) -> None:
    """find() of each state (and of any) reads the (state, updated_at) index backwards."""
    queries = settled._q  # type: ignore[attr-defined]
    params = {"prefix": None, "owner": None, "limit": 20}
    for state in STATES:
        plan = _explain(settled, queries[find_query(state)], params)
        assert _uses_indexes(plan), (state, plan)


def test_effect_find_reads_a_range_of_the_state_index(store: Store) -> None:
    """effects.find(state) on a table of receipts: that state's range of the state index
    (schema 8), read backwards, no filesort; before it, a rare state was looked for along the
    whole updated_at index."""
    _check_receipts(store)
    _write_past(store, "lease_celery_effects",
                "INSERT INTO lease_celery_effects (`key`, fingerprint, state, started_at, "
                f"attempts, version, updated_at) SELECT CONCAT('old:', seq), 'f', "
                f"{RECEIPT_STATE.format(i='seq')}, seq, 1, 1, seq FROM seq_1_to_{RECEIPTS}")
    queries = store._q  # type: ignore[attr-defined]
    for state in EffectState:
        plan = _explain(store, queries[effect_find_query(state)],
                        {"state": state.value, "limit": 100})
        assert [(step["table"], step["key"]) for step in plan] == [
            ("lease_celery_effects", "lease_celery_effects_state")], (state, plan)
        assert "filesort" not in str(plan[0]["Extra"]), (state, plan)


@pytest.mark.parametrize("query", ["stats", "sweep_candidates", "purge_old_candidates"])
def test_stats_sweep_and_retention_use_indexes(settled: Store, query: str) -> None:
    """stats() counts in the state index; the sweep reads sweep_at's; retention the terminal
    one (a generated column: NULL but for settled done/dead rows)."""
    queries = settled._q  # type: ignore[attr-defined]
    params = {"now": 1e9, "at": 1e9, "grace": 5.0, "limit": 100, "seconds": 10.0}
    plan = _explain(settled, queries[query], params)
    assert _uses_indexes(plan), plan
    wanted = {"stats": "lease_celery_leases_state", "sweep_candidates":
              "lease_celery_leases_sweep", "purge_old_candidates": "lease_celery_leases_terminal"}
    assert any(step["key"] == wanted[query] for step in plan), plan


def test_retention_purges_only_settled_rows_oldest_first(store: Store) -> None:
    """purge_older_than tombstones settled done/dead rows, oldest first, in batches; a
    settling row is kept, tokens stay."""
    assert store.purge_older_than(0, limit=1) == 1
    purged = store.purge_older_than(0)
    assert purged == 3  # the other done and both dead rows of _check_answers
    assert {r.state for r in store.find(limit=100)} == {LeaseState.READY, LeaseState.RUNNING}
