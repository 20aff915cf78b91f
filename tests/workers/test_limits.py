"""Key-group limits with real workers: three ``celery worker -c 2`` processes on the Redis
broker and a PostgreSQL store, shared by the tests of this module (each works in groups of
its own). Times are the store's clock, as the bodies read it (``worker_app._limited_run``).
"""

from __future__ import annotations

import itertools
import os
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
import redis

from lease_celery import open_store
from tests.support.policy_helpers import cli_env, parse_json, run_cli
from tests.support.servers import PG_DSN, REDIS_URL, postgres_reachable, require
from tests.support.workers import Journal, WorkerPool, client_app, worker_pool

pytestmark = pytest.mark.worker

LIMITED = "tests.support.worker_app.limited"
LIMITED_ONE = "tests.support.worker_app.limited_one"
RATED = "tests.support.worker_app.rated"
TTL, HEARTBEAT = 2.0, 0.5


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory,
         redis_client: redis.Redis) -> Iterator[WorkerPool]:
    reachable, detail = postgres_reachable()
    require("PostgreSQL", reachable, detail)
    run = uuid.uuid4().hex[:8]
    schema = f"lease_test_limits_{run}"
    store_url = f"{PG_DSN}?schema={schema}"
    env = {"LEASE_TEST_BROKER": REDIS_URL, "LEASE_TEST_QUEUE": f"lease-tests-{run}",
           "LEASE_TEST_JOURNAL": f"journal-{run}", "LEASE_TEST_STORE": store_url,
           "LEASE_TEST_TTL": str(TTL), "LEASE_TEST_HEARTBEAT": str(HEARTBEAT),
           "LEASE_TEST_SWEEP_INTERVAL": "0.5"}
    journal = Journal(redis_client, env["LEASE_TEST_JOURNAL"])
    try:
        with worker_pool(tmp_path_factory.mktemp("limits"), env, journal) as workers:
            workers.client = client_app(REDIS_URL, env["LEASE_TEST_QUEUE"])
            workers.store_url = store_url
            for name in ("a", "b", "c"):
                workers.start(name, concurrency=2)
            yield workers
            workers.client.close()
    finally:
        with psycopg.connect(PG_DSN, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def _publish(pool: WorkerPool, task: str, group: str, jobs: int, *, seconds: float = 1.0,
             ) -> list[str]:
    ids = [f"{group}-{uuid.uuid4().hex[:6]}" for _ in range(jobs)]
    for job in ids:
        args: tuple[Any, ...] = (job, group) if task == RATED else (job, group, seconds)
        pool.client.send_task(task, args=args)
    return ids


def _ended(pool: WorkerPool, jobs: list[str], *, timeout: float) -> None:
    wanted = set(jobs)
    pool.journal.wait_for(
        lambda j: wanted <= {e["job_id"] for e in j.events("limited_end")},
        timeout=timeout, what=f"{len(jobs)} limited jobs to end")


def _intervals(pool: WorkerPool, group: str, *,
               refused: set[tuple[str, int]] = frozenset()) -> list[tuple[float, float]]:
    """(start, end) on the store's clock of each run of ``group`` whose outcome was accepted
    (not in ``refused``: (key, token) of finishes refused as stale)."""
    starts = {(e["job_id"], e["token"]): e["at"]
              for e in pool.journal.events("limited_start", group=group)}
    return [(starts[(e["job_id"], e["token"])], e["at"])
            for e in pool.journal.events("limited_end", group=group)
            if (f"job:{e['job_id']}", e["token"]) not in refused]


def _most_at_once(intervals: list[tuple[float, float]]) -> int:
    # Ends sort before starts at one instant: a slot handed on is not two at once.
    edges = sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals],
                   key=lambda edge: (edge[0], edge[1]))
    running = most = 0
    for _, step in edges:
        running += step
        most = max(most, running)
    return most


def test_two_groups_of_twelve_run_two_at_a_time_each_and_every_task_once(
        pool: WorkerPool) -> None:
    """Three workers, six pool processes, two groups with ``lease_limit = 2`` and twelve
    one-second tasks each: at no instant do more than two of a group run, every task runs
    once, and each group's twelve take about six seconds, not twelve."""
    groups = {name: _publish(pool, LIMITED, f"pair-{name}-{uuid.uuid4().hex[:4]}", 12)
              for name in ("x", "y")}
    started = time.time()
    _ended(pool, [job for jobs in groups.values() for job in jobs], timeout=40)
    elapsed = time.time() - started
    for jobs in groups.values():
        group = jobs[0].rsplit("-", 1)[0]
        runs = _intervals(pool, group)
        assert _most_at_once(runs) == 2, runs
        starts = [e["job_id"] for e in pool.journal.events("limited_start", group=group)]
        assert sorted(starts) == sorted(jobs)  # once each: no job ran twice
        span = max(end for _, end in runs) - min(start for start, _ in runs)
        print(f"group {group}: 12 one-second tasks, at most 2 at once, in {span:.2f}s")
        assert 6.0 <= span < 9.0, span
    assert elapsed < 12.0, elapsed


def test_a_full_group_parks_its_waiters_and_another_group_starts_at_once(
        pool: WorkerPool) -> None:
    """``lease_limit = 1``, one holder and twenty waiters: the waiters are parked on the
    store with their messages acked, holding no pool process, and a task of another group
    starts at once; the waiters then run one at a time, in arrival order."""
    group = f"full-{uuid.uuid4().hex[:4]}"
    holder = _publish(pool, LIMITED_ONE, group, 1, seconds=3.0)
    pool.journal.wait_for(lambda j: bool(j.events("limited_start", job_id=holder[0])),
                          timeout=20, what="the holder to start")
    waiters: list[str] = []
    for parked in range(1, 21):  # one by one: their arrival order is the order they run in
        waiters += _publish(pool, LIMITED_ONE, group, 1, seconds=0.05)
        pool.journal.wait_for(lambda j, n=parked: len(j.events(
            "limit_wait", group=f"one:{group}")) >= n, timeout=10, what="the waiter to park")
    with open_store(pool.store_url) as store:
        found = store.limit_group(f"one:{group}")
        assert found is not None and (found.running, found.waiting) == (1, 20), found
    active = pool.client.control.inspect(timeout=1.0).active() or {}
    busy = [task for tasks in active.values() for task in tasks]
    assert [task["args"][0] for task in busy] == holder, busy  # the waiters hold no process
    other = f"other-{uuid.uuid4().hex[:4]}"
    published = time.time()
    job = _publish(pool, LIMITED_ONE, other, 1, seconds=0.0)
    pool.journal.wait_for(lambda j: bool(j.events("limited_start", job_id=job[0])),
                          timeout=10, what="the other group's task")
    start = pool.journal.events("limited_start", job_id=job[0])[0]["t"]
    print(f"another group's task started {start - published:.3f}s after its publish")
    assert start - published < 1.0
    _ended(pool, holder + waiters, timeout=40)
    order = [e["job_id"] for e in pool.journal.events("limited_start", group=group)]
    assert order == holder + waiters
    assert _most_at_once(_intervals(pool, group)) == 1


def _pid_running(pool: WorkerPool, job: str) -> int:
    pool.journal.wait_for(lambda j: bool(j.events("limited_start", job_id=job)), timeout=20,
                          what=f"{job} to start")
    return int(pool.journal.events("limited_start", job_id=job)[0]["pid"])


def test_a_killed_holders_slot_comes_back_and_its_waiters_go_on(pool: WorkerPool) -> None:
    """SIGKILL the pool process holding a group's one slot: its lease expires, the sweeper
    hands the slot on, and the waiters go on within about two ttl."""
    group = f"kill-{uuid.uuid4().hex[:4]}"
    holder = _publish(pool, LIMITED_ONE, group, 1, seconds=30.0)
    pid = _pid_running(pool, holder[0])
    waiters = _publish(pool, LIMITED_ONE, group, 3, seconds=0.05)
    pool.journal.wait_for(lambda j: len(j.events("limit_wait", group=f"one:{group}")) >= 3,
                          timeout=10, what="the waiters to park")
    killed = time.time()
    os.kill(pid, signal.SIGKILL)
    pool.journal.wait_for(lambda j: bool(j.events("limited_start", job_id=waiters[0])),
                          timeout=20, what="the first waiter to start")
    resumed = pool.journal.events("limited_start", job_id=waiters[0])[0]["t"] - killed
    print(f"a waiter started {resumed:.2f}s after its group's holder was SIGKILLed "
          f"(ttl {TTL}s)")
    assert resumed < 2 * TTL + 1.0
    _ended(pool, waiters, timeout=30)
    assert _most_at_once(_intervals(pool, group)) == 1


def test_a_stalled_holders_finish_is_refused_and_the_next_waiter_runs(
        pool: WorkerPool) -> None:
    """SIGSTOP the holder of a group's one slot past the ttl: the slot goes with its lease to
    the next waiter, the stalled holder's finish is refused when it wakes, and at no instant
    do two runs with an accepted outcome overlap."""
    group = f"stop-{uuid.uuid4().hex[:4]}"
    holder = _publish(pool, LIMITED_ONE, group, 1, seconds=1.0)
    pid = _pid_running(pool, holder[0])
    os.kill(pid, signal.SIGSTOP)
    try:
        waiters = _publish(pool, LIMITED_ONE, group, 2, seconds=0.5)
        pool.journal.wait_for(lambda j: bool(j.events("limited_start", job_id=waiters[0])),
                              timeout=20, what="the next waiter to take the slot")
    finally:
        os.kill(pid, signal.SIGCONT)
    key = f"job:{holder[0]}"
    pool.journal.wait_for(lambda j: bool(j.events("stale_result_rejected", key=key)),
                          timeout=20, what="the stalled holder's finish to be refused")
    # Nobody else took the holder's own key: it runs again, under a new token, in its turn.
    pool.journal.wait_for(lambda j: len(j.events("limited_end", job_id=holder[0])) >= 2,
                          timeout=30, what="the holder's key to run again")
    _ended(pool, waiters, timeout=20)
    refused = {(e["key"], e["token"]) for e in pool.journal.events("stale_result_rejected")}
    assert (key, pool.journal.events("limited_start", job_id=holder[0])[0]["token"]) in refused
    accepted = _intervals(pool, group, refused=refused)
    assert len(accepted) == 3 and _most_at_once(accepted) == 1, accepted
    starts = pool.journal.events("limited_start", group=group)
    slots = [e["slot"] for e in starts]
    assert slots == sorted(slots) and len(set(slots)) == len(slots), starts  # a grant each


def test_a_rate_limit_holds_across_three_workers(pool: WorkerPool) -> None:
    """``lease_rate_limit = "4/s"`` and twelve tasks at once across three workers: no
    one-second window of the store's clock holds more than four starts. Celery's own
    ``rate_limit = "4/s"`` is per worker: three workers would start twelve in that second.

    A start is the claim the store granted, at the instant its history records (the claim
    statement's own clock): a body's later reading of the store's clock comes a few
    milliseconds after its claim, by more or less, so two bodies' readings were once 0.2492 s
    apart for grants at least 0.25 s apart (CI)."""
    jobs = _publish(pool, RATED, "rated", 12)
    _ended(pool, jobs, timeout=30)
    assert len([e for e in pool.journal.events("limited_start", group="rated")
                if e["job_id"] in jobs]) == 12
    store = open_store(pool.store_url)
    try:
        starts = sorted(next(entry.at for entry in store.history(f"job:{job}")
                             if entry.event == "claimed") for job in jobs)
    finally:
        store.close()
    assert len(starts) == 12
    windows = [sum(1 for s in starts if first <= s < first + 1.0) for first in starts]
    print(f"12 starts at 4/s over {starts[-1] - starts[0]:.2f}s; busiest second: "
          f"{max(windows)}")
    assert max(windows) <= 4, starts
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    assert min(gaps) >= 0.25 - 1e-6, gaps


def test_raising_a_full_groups_limit_starts_a_waiter_at_once(pool: WorkerPool,
                                                             tmp_path: Path) -> None:
    """``celery leases limit GROUP --limit 3`` on a group full at two: a waiter starts at
    once (the command publishes it), within a heartbeat interval."""
    group = f"raise-{uuid.uuid4().hex[:4]}"
    holders = _publish(pool, LIMITED, group, 2, seconds=4.0)
    for job in holders:
        _pid_running(pool, job)
    waiters = _publish(pool, LIMITED, group, 2, seconds=0.05)
    pool.journal.wait_for(lambda j: len(j.events("limit_wait", group=f"group:{group}")) >= 2,
                          timeout=10, what="the waiters to park")
    env = cli_env(pool.store_url, {"LEASE_TEST_QUEUE": pool.env["LEASE_TEST_QUEUE"]})
    done = run_cli(["limit", f"group:{group}", "--limit", "3", "--json"], env=env,
                   cwd=tmp_path)
    returned = time.time()
    assert done.returncode == 0, done.stderr
    answer = parse_json(done)
    assert (answer["limit"], answer["limit_set"], answer["task_limit"]) == (3, True, 2)
    # The first to arrive of the two (they were published at once).
    assert len(answer["handed_on"]) == 1 and answer["handed_on"][0] in [
        f"job:{job}" for job in waiters], answer
    first = answer["handed_on"][0].removeprefix("job:")
    pool.journal.wait_for(lambda j: bool(j.events("limited_start", job_id=first)),
                          timeout=10, what="a waiter to start")
    started = pool.journal.events("limited_start", job_id=first)[0]["t"]
    print(f"a waiter started {started - returned:.3f}s after the command returned")
    assert started - returned < HEARTBEAT
    listed = parse_json(run_cli(["limits", "--json"], env=env, cwd=tmp_path))
    mine = [g for g in listed if g["group"] == f"group:{group}"]
    assert mine and (mine[0]["limit"], mine[0]["limit_set"]) == (3, True), listed
