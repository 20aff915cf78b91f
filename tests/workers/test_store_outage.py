"""A delivery that meets an unavailable store: real workers, a Redis store behind a proxy that
refuses connections (as a restarting server does) for a while.

A blip shorter than a ttl costs no re-publish: the delivery waits for the store and runs once;
a finish that meets it waits too, while the lease lasts, instead of running the body again.
A worker that shuts down while a delivery waits defers it at once, so the worker stops and the
work is not lost. (An outage longer than the wait still defers the delivery: the SQLite test of
tests/workers/test_worker_delivery.py, whose store stays locked until the deferral is seen.)
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from urllib.parse import urlsplit

import pytest

from tests.support.proxy import CuttableProxy
from tests.support.tokens import token_base
from tests.support.workers import WorkerPool

pytestmark = pytest.mark.worker

WORK = "tests.support.worker_app.work"
UNCHECKED = "tests.support.worker_app.unchecked"


@pytest.fixture
def proxy(worker_store: str) -> Iterator[CuttableProxy]:
    """A proxy in front of the Redis of ``worker_store``."""
    parts = urlsplit(worker_store)
    proxy = CuttableProxy(parts.hostname or "127.0.0.1", parts.port or 6379)
    try:
        yield proxy
    finally:
        proxy.cut()


def _through(proxy: CuttableProxy, url: str) -> str:
    parts = urlsplit(url)
    return parts._replace(netloc=f"127.0.0.1:{proxy.port}").geturl()


def _at_the_gate(workers: WorkerPool, task_id: str) -> None:
    workers.journal.wait_for(lambda j: bool(j.events("task_prerun", task_id=task_id)),
                             timeout=20, what="the delivery to reach the lease gate")


@pytest.mark.parametrize("worker_store", ["redis"], indirect=True)
@pytest.mark.worker_env(LEASE_TEST_TTL="2", LEASE_TEST_HEARTBEAT="0.5")
def test_a_store_blip_costs_no_republish(workers: WorkerPool, proxy: CuttableProxy) -> None:
    """The store refuses connections for about a second from the moment a delivery reaches
    the gate: the delivery waits, runs once, and is never re-published."""
    workers.env["LEASE_TEST_STORE"] = _through(proxy, workers.store_url)
    workers.start("a", concurrency=1)
    warm = workers.client.send_task(WORK, args=(uuid.uuid4().hex[:10], 0.0))
    # The worker holds store connections now.
    assert warm.get(timeout=30)["token"] == token_base(workers.store_url) + 1

    job, task_id = uuid.uuid4().hex[:10], str(uuid.uuid4())
    proxy.down()
    try:
        result = workers.client.send_task(WORK, args=(job, 0.0), task_id=task_id)
        _at_the_gate(workers, task_id)
        time.sleep(1.0)  # the outage: shorter than the ttl (2 s)
    finally:
        proxy.up()

    assert result.get(timeout=30)["token"] == token_base(workers.store_url) + 1
    assert workers.journal.events("duplicate_deferred", key=f"job:{job}") == []
    assert len(workers.journal.events("body_start", job_id=job)) == 1
    assert len(workers.journal.events("task_prerun", task_id=task_id)) == 1  # no second copy


@pytest.mark.parametrize("worker_store", ["redis"], indirect=True)
@pytest.mark.worker_env(LEASE_TEST_TTL="3", LEASE_TEST_HEARTBEAT="0.5")
def test_a_store_blip_during_the_finish_costs_no_second_run(
        workers: WorkerPool, proxy: CuttableProxy) -> None:
    """The store refuses connections from the start of a 0.5 s body until 1.5 s later: the
    finish meets the outage, waits for the store while the lease (3 s) lasts, and lands; the
    body runs once and nothing is re-published."""
    workers.env["LEASE_TEST_STORE"] = _through(proxy, workers.store_url)
    workers.start("a", concurrency=1)
    job = uuid.uuid4().hex[:10]
    result = workers.client.send_task(UNCHECKED, args=(job, 0.5))
    workers.journal.wait_for(lambda j: bool(j.events("body_start", job_id=job)), timeout=20,
                             what="the body to start")
    proxy.down()
    try:
        workers.journal.wait_for(lambda j: bool(j.events("body_end", job_id=job)), timeout=20,
                                 what="the body to end (its finish meets the outage)")
        time.sleep(1.0)
    finally:
        proxy.up()

    assert result.get(timeout=30)["token"] == token_base(workers.store_url) + 1
    assert workers.journal.events("duplicate_deferred", key=f"job:{job}") == []
    assert len(workers.journal.events("body_start", job_id=job)) == 1


@pytest.mark.parametrize("worker_store", ["redis"], indirect=True)
@pytest.mark.worker_env(LEASE_TEST_TTL="30", LEASE_TEST_HEARTBEAT="5")
def test_a_worker_shutting_down_defers_the_waiting_delivery(
        workers: WorkerPool, proxy: CuttableProxy) -> None:
    """A thread-pool worker gets SIGTERM while its delivery waits for the store (which would
    last a ttl, 30 s): the delivery is deferred at once, naming the shutdown, the worker stops
    by itself, and the deferred copy runs once on the next worker."""
    workers.env["LEASE_TEST_STORE"] = _through(proxy, workers.store_url)
    first = workers.start("a", concurrency=1, pool="threads")
    job, task_id = uuid.uuid4().hex[:10], str(uuid.uuid4())
    proxy.down()
    try:
        result = workers.client.send_task(WORK, args=(job, 0.0), task_id=task_id)
        _at_the_gate(workers, task_id)
        first.stop()  # SIGTERM; SIGKILL if the warm shutdown hangs for 10 s
    finally:
        proxy.up()
    deferred = workers.journal.events("duplicate_deferred", key=f"job:{job}")
    assert len(deferred) == 1 and "shutting down" in deferred[0]["reason"], deferred
    assert first.process.returncode == 0, first.output()[-3000:]

    workers.start("b", concurrency=1)
    assert result.get(timeout=30)["token"] == token_base(workers.store_url) + 1
    assert len(workers.journal.events("body_start", job_id=job)) == 1
