"""Fixtures shared by the test suite: real servers, real worker processes."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tests.servers import REDIS_URL, require
from tests.workers import Journal, WorkerPool, client_app, worker_pool


@pytest.fixture(scope="session")
def redis_client() -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(REDIS_URL, socket_connect_timeout=2)
    try:
        client.ping()
    except redis.RedisError as exc:
        require("Redis", False, f"{REDIS_URL}: {exc}")
    client.flushdb()
    yield client
    client.flushdb()


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path}/leases.sqlite3"


@pytest.fixture
def workers(request: pytest.FixtureRequest, tmp_path: Path, redis_client: redis.Redis,
            sqlite_url: str) -> Iterator[WorkerPool]:
    """A pool of real celery workers on a queue, journal and SQLite store of this test's own.

    A test marked ``@pytest.mark.worker_env(LEASE_TEST_TTL="1", ...)`` overrides settings.
    """
    run = uuid.uuid4().hex[:8]
    env = {"LEASE_TEST_BROKER": REDIS_URL, "LEASE_TEST_QUEUE": f"lease-tests-{run}",
           "LEASE_TEST_JOURNAL": f"journal-{run}", "LEASE_TEST_STORE": sqlite_url}
    marker = request.node.get_closest_marker("worker_env")
    if marker is not None:
        env.update(marker.kwargs)
    journal = Journal(redis_client, env["LEASE_TEST_JOURNAL"])
    with worker_pool(tmp_path, env, journal) as pool:
        pool.client = client_app(REDIS_URL, env["LEASE_TEST_QUEUE"])
        pool.store_url = sqlite_url
        yield pool
        if request.node.rep_call.failed if hasattr(request.node, "rep_call") else False:
            print(pool.logs())


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    report = yield
    setattr(item, f"rep_{report.when}", report)
    return report
