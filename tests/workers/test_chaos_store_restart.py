"""The chaos harness's ``store-restart`` fault: opt-in, planned over the window, counted.

The full runs restart the store's server (``--faults all,store-restart``); these tests check
the parts without a run: ``all`` leaves the fault out (it restarts the machine's PostgreSQL,
which other test runs use), a CI run refuses it on PostgreSQL, a redis-server of the run's
own keeps its keys across a restart with ``aof`` and loses them with ``none``, and the table
counts the deferrals each outage caused.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest

from benchmarks.chaos.checker import check
from benchmarks.chaos.faults import FAULTS, parse_faults, plan_faults
from benchmarks.chaos.run import HarnessError, RunOptions, run
from benchmarks.chaos.storeserver import PORTS, OwnRedis
from tests.support.servers import missing
from tests.workers.test_chaos import _event, clean_history


def test_all_leaves_the_store_restart_out_until_it_is_named() -> None:
    """``all`` is what CI's short runs use: it never restarts a server; the fault is named."""
    assert parse_faults("all", "postgres") == (list(FAULTS), [])
    kinds, _ = parse_faults("all,store-restart", "redis")
    assert kinds == [*FAULTS, "store-restart"]
    kinds, skipped = parse_faults("kill,store-restart", "sqlite")
    assert kinds == ["kill"] and "store-restart" in skipped[0]
    with pytest.raises(ValueError, match="unknown fault"):
        parse_faults("store-restarts", "redis")


def test_a_full_run_plans_six_restarts_spread_over_the_window() -> None:
    """1,000 tasks (a 67 s window): six restarts, one in each sixth of the window's middle."""
    window = 1000 / 15
    at = [f.at for f in plan_faults(["store-restart"], window, random.Random(7))]
    assert len(at) == 6
    slices = [int((t / window - 0.1) / 0.8 * 6) for t in at]
    assert slices == [0, 1, 2, 3, 4, 5]


def test_a_ci_run_refuses_to_restart_the_machines_postgres(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Refused before anything starts: the cluster serves the CI run's other tests too."""
    monkeypatch.setenv("CI", "true")
    with pytest.raises(HarnessError, match="on postgres restarts the machine's server"):
        run(RunOptions(store="postgres", tasks=10, faults="kill,store-restart"))


@pytest.mark.parametrize(("persistence", "kept"), [("aof", True), ("none", False)])
def test_the_runs_own_redis_restarts_on_its_port(tmp_path: Path, persistence: str,
                                                 kept: bool) -> None:
    """appendonly yes / appendfsync always keeps an acknowledged write across the restart;
    without persistence the server comes back empty (what the Redis store's epoch catches)."""
    if shutil.which("redis-server") is None:
        missing("redis-server is not installed (Debian's redis-server package)")
    server = OwnRedis(tmp_path / "redis", persistence=persistence)
    server.start()
    try:
        port = server.port
        assert port in PORTS
        server.client().set("written", "before the restart")
        server.restart(0.1)
        assert server.port == port
        assert (server.client().get("written") is not None) is kept
    finally:
        server.close()


def test_the_table_counts_the_deferrals_of_each_outage() -> None:
    """Deferrals for an unavailable store (claim or finish) are told apart from a live
    holder's, and each restart gets those from its start to two ttls after its end."""
    history = clean_history()
    history.events += [
        _event("fault", 10.0, 1, kind="store-restart", server="redis :16400"),
        _event("duplicate_deferred", 10.5, 21, key="job:j9",
               reason="the lease store failed (redis lease store at 127.0.0.1:1: refused)"),
        _event("duplicate_deferred", 11.0, 21, key="job:j8",
               reason="finish failed in the lease store (refused)"),
        _event("duplicate_deferred", 11.2, 21, key="job:j7",
               reason="lease 'job:j7' is held by w:1:x (token 1) for another 1.0s"),
        _event("fault_end", 12.0, 1, kind="store-restart", seconds=2.0),
        _event("fault", 30.0, 1, kind="store-restart", server="redis :16400"),
        _event("fault_end", 30.5, 1, kind="store-restart", seconds=0.5),
        _event("duplicate_deferred", 60.0, 21, key="job:j6",
               reason="the lease store failed (redis lease store at 127.0.0.1:1: refused)"),
    ]
    counts = check(history).counts
    assert counts["deferred duplicates"] == 4
    assert counts["deferred for the store (claim, finish)"] == "3 (2, 1)"
    assert counts["store restarts (down: deferred)"] == "2 (2.0s: 2, 0.5s: 0)"


def test_the_table_counts_workers_that_died_or_hung_without_a_fault() -> None:
    history = clean_history()
    history.events += [
        _event("worker_exit", 8.0, 1, worker="w1", main_pid=10, returncode=-9),  # killed
        _event("worker_exit", 9.0, 1, worker="w2", main_pid=20, returncode=1),
        _event("workers_stopped", 20.0, 1, count=3, hung=["w3"]),
    ]
    counts = check(history).counts
    assert counts["worker exits without a fault"] == 1
    assert counts["workers hung at stop (SIGKILLed)"] == 1
