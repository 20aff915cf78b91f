"""Fixtures shared by the test suite: real servers, real worker processes."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from lease_celery import Store, open_store
from lease_celery.runtime import history
from lease_celery.testing import ManualClock
from tests.support.servers import (
    PG_DSN,
    REDIS_STORE_URL,
    REDIS_URL,
    mysql_reachable,
    postgres_reachable,
    redis_reachable,
    require,
)
from tests.support.workers import Journal, WorkerPool, client_app, worker_pool

#: tests/django_integration sets Django up in its process with its own project's settings:
#: it runs in a pytest of its own (LEASE_TEST_DJANGO=1, as .ci/run does), never beside
#: tests/workers/test_beat_integrations.py, which sets Django up with others.
collect_ignore = [] if os.environ.get("LEASE_TEST_DJANGO") else ["django_integration"]


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
def postgres_url() -> Iterator[str]:
    """A PostgreSQL store URL on a schema of this test's own, dropped afterwards."""
    reachable, detail = postgres_reachable()
    require("PostgreSQL", reachable, detail)
    import psycopg

    schema = f"lease_test_{uuid.uuid4().hex[:12]}"
    yield f"{PG_DSN}?schema={schema}"
    with psycopg.connect(PG_DSN, autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


@pytest.fixture
def mysql_url() -> Iterator[str]:
    """A MySQL store URL on a database of this test's own (an emptied one of an earlier test
    of this process: tests/support/mysql_databases.py)."""
    reachable, detail = mysql_reachable()
    require("MariaDB", reachable, detail)
    from tests.support.mysql_databases import database

    with database() as url:
        yield url
        history.flush()  # entries still queued (a sweep's) would land after the clean-up


@pytest.fixture(scope="session", autouse=True)
def _mysql_databases() -> Iterator[None]:
    """The pooled MySQL test databases are dropped when the test process ends."""
    yield
    from tests.support.mysql_databases import drop_pool

    drop_pool()


@pytest.fixture
def redis_store_url() -> Iterator[str]:
    """A Redis store URL with a key prefix of this test's own, whose keys are deleted after."""
    reachable, detail = redis_reachable()
    require("Redis", reachable, detail)
    prefix = f"lease_test_{uuid.uuid4().hex[:12]}:"
    yield f"{REDIS_STORE_URL}?prefix={prefix}"
    history.flush()  # entries still queued (a sweep's) would land after the clean-up
    client = redis.Redis.from_url(REDIS_STORE_URL)
    for key in client.scan_iter(f"{prefix}*"):
        client.delete(key)


STORES = ["sqlite", "postgres", "redis", "mysql"]


@pytest.fixture
def clock() -> ManualClock:
    """The injected authority clock shared by a test's stores; moves only when told to."""
    return ManualClock(100.0)


@pytest.fixture
def stores(store_url: str, clock: ManualClock) -> Iterator[list[Store]]:
    """Two workers' stores: ``open_store`` twice on one URL and clock, so each has its own
    connection (and, on PostgreSQL, its own pool)."""
    opened = [open_store(store_url, clock=clock), open_store(store_url, clock=clock)]
    yield opened
    for store in opened:
        store.close()


def fresh_store_url(request: pytest.FixtureRequest, kind: str) -> str:
    """A fresh, isolated store URL of ``kind`` (sqlite, postgres, redis or mysql) for this
    test."""
    name = {"sqlite": "sqlite_url", "postgres": "postgres_url", "redis": "redis_store_url",
            "mysql": "mysql_url"}[kind]
    url: str = request.getfixturevalue(name)
    return url


@pytest.fixture(params=STORES)
def store_url(request: pytest.FixtureRequest) -> str:
    """The same test body against every store: a fresh, isolated store URL of each kind."""
    return fresh_store_url(request, request.param)


@pytest.fixture
def worker_store(request: pytest.FixtureRequest) -> str:
    """The lease store the workers share: SQLite unless the test parametrizes it indirectly."""
    return fresh_store_url(request, getattr(request, "param", "sqlite"))


@pytest.fixture
def workers(request: pytest.FixtureRequest, tmp_path: Path, redis_client: redis.Redis,
            worker_store: str) -> Iterator[WorkerPool]:
    """A pool of real celery workers on a queue, journal and SQLite store of this test's own.

    A test marked ``@pytest.mark.worker_env(LEASE_TEST_TTL="1", ...)`` overrides settings.
    """
    run = uuid.uuid4().hex[:8]
    env = {"LEASE_TEST_BROKER": REDIS_URL, "LEASE_TEST_QUEUE": f"lease-tests-{run}",
           "LEASE_TEST_JOURNAL": f"journal-{run}", "LEASE_TEST_STORE": worker_store}
    marker = request.node.get_closest_marker("worker_env")
    if marker is not None:
        env.update(marker.kwargs)
    journal = Journal(redis_client, env["LEASE_TEST_JOURNAL"])
    with worker_pool(tmp_path, env, journal) as pool:
        pool.client = client_app(REDIS_URL, env["LEASE_TEST_QUEUE"])
        pool.store_url = worker_store
        yield pool
        if request.node.rep_call.failed if hasattr(request.node, "rep_call") else False:
            print(pool.logs())


#: The tiers, each a folder of tests/ and a marker of the same name (``pytest -m unit``).
TIERS = ("unit", "stores", "workers")


#: The files of .ci/run's parallel tier with the most test time (50-80 s each under its load,
#: 2026-12-06), heaviest first. pytest-xdist hands whole files out (--dist loadfile) in
#: collection order (--no-loadscope-reorder): these are collected first, so that no process
#: starts one of them while the others are nearly done (the tier took 353 s against 384 s in
#: xdist's own order, by test count: one fresh-clone run of each, same build). A file not
#: named here keeps its place after them.
HEAVIEST_FIRST = ("workers/test_cli.py", "workers/test_benchmarks.py",
                  "workers/test_worker_delivery.py", "workers/test_worker_policy.py",
                  "workers/test_extras.py", "workers/test_rabbitmq.py", "workers/test_demo.py",
                  "workers/test_beat_integrations.py")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test with its tier, the folder under tests/ it lives in; collect the
    heaviest files first (``HEAVIEST_FIRST``)."""
    root = Path(__file__).resolve().parent
    ranks: dict[pytest.Item, int] = {}
    for item in items:
        try:
            parts = item.path.resolve().relative_to(root).parts
        except ValueError:
            ranks[item] = len(HEAVIEST_FIRST)
            continue
        if parts[0] in TIERS:
            item.add_marker(getattr(pytest.mark, parts[0]))
        path = "/".join(parts)
        ranks[item] = (HEAVIEST_FIRST.index(path) if path in HEAVIEST_FIRST
                       else len(HEAVIEST_FIRST))
    items.sort(key=ranks.__getitem__)  # stable: the rest in their collection order


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    report = yield
    setattr(item, f"rep_{report.when}", report)
    return report
