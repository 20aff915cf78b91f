"""Mutual exclusion under real contention: 16 OS processes on one store, real clock.

The same bodies run on SQLite (one file), PostgreSQL (one schema) and Redis (one key prefix)
through the ``store_url`` fixture. Each child process opens its own store from the URL
(forked from a ``forkserver``, a fresh process: nothing of the test's is inherited) and
reports back through a queue; any exception in a child, ``database is locked``,
``StoreBusy`` and ``StoreError`` included, fails the test.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import random
import socket
import threading
import time
import traceback
import uuid
from itertools import pairwise
from typing import Any

from lease_celery import LeaseState, open_store
from tests.support.tokens import token_base

PROCESSES = 16
HOLD_TTL = 30.0  # far longer than the test: nothing may expire, only release frees the key
LOOP_SECONDS = 2.0
RACE_KEYS = 20
COLLECT_TIMEOUT = 60.0
BARRIER_TIMEOUT = 30.0

THREADS = 8
THREAD_KEYS = 30

# A forkserver, not spawn: each child is a fork of one fresh server process that imported the
# library and the store modules once (their connections are made in each child), where a
# spawned child imported them again: 16 children x 4 stores x 2 tests, ~0.35 s of CPU each,
# were a fifth of the store tier's CPU on the two-core machine.
_ctx = multiprocessing.get_context("forkserver")
_ctx.set_forkserver_preload([
    "lease_celery", "lease_celery.stores.sqlite", "lease_celery.stores.postgres",
    "lease_celery.stores.redis", "lease_celery.stores.mysql", "tests.support.tokens"])


def _owner() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4()}"


def _hold_and_release(url: str, key: str, index: int, start: Any, results: Any) -> None:
    """Child: claim ``key`` in a loop for LOOP_SECONDS; on each win, check the row, hold
    briefly, release. Reports its holds, or the traceback of whatever went wrong."""
    try:
        store = open_store(url)
        owner = _owner()
        store.get(key)  # connect and create the schema before the start line
        holds: list[tuple[int, str, float, float]] = []
        attempts = 0
        start.wait(timeout=BARRIER_TIMEOUT)
        deadline = time.monotonic() + LOOP_SECONDS
        while time.monotonic() < deadline:
            lease = store.claim(key, owner=owner, ttl=HOLD_TTL)
            attempts += 1
            if lease is None:
                continue
            t_acquired = time.time()
            record = store.get(key)
            if record is None or (record.state, record.owner, record.token) != (
                LeaseState.RUNNING,
                owner,
                lease.token,
            ):
                raise AssertionError(f"holding token {lease.token} as {owner}, row is {record}")
            time.sleep(random.uniform(0, 0.002))  # let the others try (and fail) meanwhile
            t_release = time.time()
            if store.release(lease) is not True:
                raise AssertionError(f"release of the current lease {lease} was refused")
            holds.append((lease.token, owner, t_acquired, t_release))
        store.close()
        results.put(("ok", index, {"holds": holds, "attempts": attempts}))
    except BaseException:
        start.abort()  # nobody waits out the barrier timeout for a child that already failed
        results.put(("error", index, traceback.format_exc()))


def _race_and_finish(url: str, keys: list[str], index: int, barrier: Any, results: Any) -> None:
    """Child: for each key, all children claim at once (barrier); the winner finishes; then all
    claim the finished key again. Reports wins and any claim that succeeded after the finish."""
    try:
        store = open_store(url)
        owner = _owner()
        store.get(keys[0])  # connect and create the schema before the first round
        wins: list[tuple[str, int]] = []
        late: list[tuple[str, Any]] = []
        for key in keys:
            barrier.wait(timeout=BARRIER_TIMEOUT)
            lease = store.claim(key, owner=owner, ttl=HOLD_TTL)
            if lease is not None:
                if store.finish(lease, {"key": key, "winner": owner}) is not True:
                    raise AssertionError(f"finish of the current lease {lease} was refused")
                wins.append((key, lease.token))
            barrier.wait(timeout=BARRIER_TIMEOUT)
            again = store.claim(key, owner=owner, ttl=HOLD_TTL)
            if again is not None:
                late.append((key, again))
        store.close()
        results.put(("ok", index, {"owner": owner, "wins": wins, "late": late}))
    except BaseException:
        barrier.abort()  # the others' barrier waits fail at once instead of timing out
        results.put(("error", index, traceback.format_exc()))


def _run_children(target: Any, args: tuple[Any, ...], sync: Any) -> dict[int, Any]:
    """Start PROCESSES children running ``target(*args, index, sync, results)``; return their
    reports by index. Fails on any child error, crash, or silence."""
    results = _ctx.Queue()
    procs = [
        _ctx.Process(target=target, args=(*args, i, sync, results), daemon=True)
        for i in range(PROCESSES)
    ]
    for proc in procs:
        proc.start()
    reports: dict[int, Any] = {}
    errors: list[str] = []
    deadline = time.monotonic() + COLLECT_TIMEOUT
    try:
        while len(reports) + len(errors) < PROCESSES and time.monotonic() < deadline:
            try:
                status, index, payload = results.get(timeout=0.5)
            except queue.Empty:
                if all(not proc.is_alive() for proc in procs) and results.empty():
                    break  # everyone exited; whoever did not report crashed
                continue
            if status == "ok":
                reports[index] = payload
            else:
                errors.append(f"child {index}:\n{payload}")
    finally:
        for proc in procs:
            proc.join(timeout=10)
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
    # the first failure first: the others then only report the barrier it broke
    errors.sort(key=lambda text: "BrokenBarrierError" in text)
    assert not errors, "\n".join(errors)
    missing = sorted(set(range(PROCESSES)) - set(reports))
    assert not missing, f"children {missing} never reported; exit codes " + str(
        [procs[i].exitcode for i in missing]
    )
    assert [proc.exitcode for proc in procs] == [0] * PROCESSES
    return reports


def test_sixteen_processes_never_hold_one_key_at_once(store_url: str) -> None:
    """16 processes claim one key for ~2 s (real clock, ttl 30 s so nothing expires), each
    winner checking the row shows it as owner with its token, then releasing (always True).
    No child raises (no 'database is locked', no StoreBusy); every token is granted exactly
    once, tokens are exactly base+1..base+N (base: the store's floor, 0 on the SQL stores);
    sorted by token each hold ends (t_release) before the next begins (t_acquired), so there
    were never two live holders; and N > 16."""
    url = store_url
    key = "report:42"
    reports = _run_children(_hold_and_release, (url, key), _ctx.Barrier(PROCESSES))

    holds = sorted(hold for report in reports.values() for hold in report["holds"])
    tokens = [token for token, _owner, _acq, _rel in holds]
    assert len(tokens) > PROCESSES, f"only {len(tokens)} claims succeeded"
    assert len(set(tokens)) == len(tokens), "a token was granted twice"
    base = token_base(url)
    assert tokens == list(range(base + 1, base + len(tokens) + 1)), (
        f"tokens are not contiguous from {base + 1}")
    for (token, owner, _acq, released), (next_token, next_owner, acquired, _rel) in pairwise(holds):
        assert released <= acquired, (
            f"token {next_token} ({next_owner}) acquired at {acquired:.6f}, before token "
            f"{token} ({owner}) was released at {released:.6f}"
        )
    winners = {owner for _token, owner, _acq, _rel in holds}
    assert len(winners) > 1, "one process won every claim"

    with open_store(url) as store:
        record = store.get(key)
    assert record is not None
    assert record.state is LeaseState.READY
    assert record.token == tokens[-1]
    assert record.attempts == tokens[-1] - base == len(tokens)


def test_sixteen_processes_race_fresh_keys_one_winner_each(store_url: str) -> None:
    """16 processes claim each of a series of fresh keys at the same instant: exactly one wins
    each key (token base + 1) and finishes it; afterwards every process's claim of that key fails,
    and the row is done with the winner's result."""
    url = store_url
    keys = [f"report:{i}" for i in range(RACE_KEYS)]
    reports = _run_children(_race_and_finish, (url, keys), _ctx.Barrier(PROCESSES))

    late = [entry for report in reports.values() for entry in report["late"]]
    assert not late, f"claims succeeded on finished keys: {late}"
    winners: dict[str, list[tuple[str, int]]] = {key: [] for key in keys}
    for report in reports.values():
        for key, token in report["wins"]:
            winners[key].append((report["owner"], token))
    assert {key: len(won) for key, won in winners.items()} == dict.fromkeys(keys, 1)

    with open_store(url) as store:
        base = token_base(store)
        for key in keys:
            ((owner, token),) = winners[key]
            assert token == base + 1
            record = store.get(key)
            assert record is not None
            assert (record.state, record.owner, record.token, record.attempts) == (
                LeaseState.DONE,
                owner,
                base + 1,
                1,
            )
            assert record.result == {"key": key, "winner": owner}


def test_threads_with_a_store_each_race_fresh_keys_one_winner_each(store_url: str) -> None:
    """8 threads, each with a store object of its own (on PostgreSQL: its own pool and
    connection, so the claims really run in parallel server-side), claim each of 30 fresh keys
    at the same instant (barrier): every claim returns a Lease or None (no exception), exactly
    one wins each key with token base + 1, and the row names that winner with one attempt."""
    keys = [f"report:thread:{i}" for i in range(THREAD_KEYS)]
    owners = [_owner() for _ in range(THREADS)]
    stores = [open_store(store_url) for _ in range(THREADS)]
    barrier = threading.Barrier(THREADS)
    got: dict[str, list[Any]] = {key: [None] * THREADS for key in keys}
    errors: list[str] = []

    def run(index: int) -> None:
        try:
            store = stores[index]
            store.get(keys[0])  # connect (and create the schema) before the first round
            for key in keys:
                barrier.wait(timeout=BARRIER_TIMEOUT)
                got[key][index] = store.claim(key, owner=owners[index], ttl=HOLD_TTL)
        except BaseException:
            barrier.abort()
            errors.append(f"thread {index}:\n{traceback.format_exc()}")

    threads = [threading.Thread(target=run, args=(i,)) for i in range(THREADS)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=COLLECT_TIMEOUT)
        assert not any(thread.is_alive() for thread in threads), "a racing claim never returned"
        errors.sort(key=lambda text: "BrokenBarrierError" in text)
        assert not errors, "\n".join(errors)

        base = token_base(stores[0])
        for key in keys:
            winners = [(i, lease) for i, lease in enumerate(got[key]) if lease is not None]
            assert len(winners) == 1, f"{key}: {got[key]}"
            ((index, lease),) = winners
            assert (lease.key, lease.owner, lease.token) == (key, owners[index], base + 1)
            record = stores[0].get(key)
            assert record is not None
            assert (record.state, record.owner, record.token, record.attempts) == (
                LeaseState.RUNNING, owners[index], base + 1, 1)
    finally:
        for store in stores:
            store.close()
