"""Reaching the real servers the tests need: fail under CI, skip with a reason locally."""

from __future__ import annotations

import os
from typing import NoReturn

import pytest

REDIS_HOST = os.environ.get("LEASE_TEST_REDIS_HOST", "127.0.0.1")
REDIS_PORT = int(os.environ.get("LEASE_TEST_REDIS_PORT", "6379"))
#: The Redis databases a run's pytest-xdist workers own (gw0 the first), one each: a run
#: flushes its own before and after, so parallel workers (and two runs on one Redis) must not
#: share one, and nothing else may use them. LEASE_TEST_REDIS_DBS="5,4,3,2" replaces the list
#: (a second run on the same Redis gives its own). The others in use, none of them flushed
#: but 12, each key there a run's or a test's own: 7 (beat and beat integration tests), 9 and
#: 14 (benchmarks' broker and stores, the chaos harness's stores), 12 (the demo, flushed by
#: tests/workers/test_demo.py), 13 (store tests, a key prefix per test), 15 (the chaos
#: harness's broker, tests/workers/test_otel.py's workers). Database 1 is no test's: it is the
#: default of ``python -m benchmarks.celery_compat`` (Celery's integration tests, flushed), whose
#: test here gives it this process's own database instead.
WORKER_DBS = tuple(int(db) for db in os.environ.get("LEASE_TEST_REDIS_DBS", "").split(",")
                   if db.strip()) or (11, 10, 8, 6, 5, 4, 3, 2)
#: This process's xdist worker number (0 without xdist).
WORKER_INDEX = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
if len(WORKER_DBS) <= WORKER_INDEX:
    raise RuntimeError(f"pytest-xdist worker gw{WORKER_INDEX} has no Redis database of its own: "
                       f"run at most -n {len(WORKER_DBS)}, or list more in LEASE_TEST_REDIS_DBS")
#: The Redis database this test process owns; it is flushed before and after the run.
REDIS_DB = int(os.environ.get("LEASE_TEST_REDIS_DB", str(WORKER_DBS[WORKER_INDEX])))
REDIS_URL = f"redis://{REDIS_HOST}:{REDIS_PORT}/{REDIS_DB}"


def missing(message: str) -> NoReturn:
    """Something a test needs is missing: that fails the run in CI (CI=true) and skips the
    test elsewhere."""
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(message)
    pytest.skip(message)


def require(server: str, reachable: bool, detail: str) -> None:
    """A missing server fails the run in CI (CI=true) and skips the test elsewhere."""
    if not reachable:
        missing(f"{server} is not reachable ({detail}); see ../shared/services.md to start it")

PG_DSN = os.environ.get("LEASE_TEST_PG", "postgresql://127.0.0.1:5432/test")
#: Redis database for store tests (keys under a per-test prefix, deleted afterwards).
REDIS_STORE_DB = int(os.environ.get("LEASE_TEST_REDIS_STORE_DB", "13"))
REDIS_STORE_URL = f"redis://{REDIS_HOST}:{REDIS_PORT}/{REDIS_STORE_DB}"


#: The MariaDB (or MySQL) server of the MySQL store's tests: each test has a database of its
#: own (tests/support/mysql_databases.py).
MYSQL_URL = os.environ.get("LEASE_TEST_MYSQL", "mysql://root@127.0.0.1:3306")


def mysql_reachable() -> tuple[bool, str]:
    try:
        from tests.support.mysql_databases import server_connection

        server_connection().close()
        return True, ""
    except Exception as exc:  # any failure means: not usable for the tests
        return False, f"{MYSQL_URL}: {exc}"


def postgres_reachable() -> tuple[bool, str]:
    try:
        import psycopg

        with psycopg.connect(PG_DSN, connect_timeout=3):
            return True, ""
    except Exception as exc:  # any failure means: not usable for the tests
        return False, f"{PG_DSN}: {exc}"


def redis_reachable() -> tuple[bool, str]:
    import redis

    try:
        redis.Redis.from_url(REDIS_STORE_URL, socket_connect_timeout=3).ping()
        return True, ""
    except redis.RedisError as exc:
        return False, f"{REDIS_STORE_URL}: {exc}"


RABBITMQ_HOST = os.environ.get("LEASE_TEST_RABBITMQ_HOST", "127.0.0.1")
RABBITMQ_PORT = int(os.environ.get("LEASE_TEST_RABBITMQ_PORT", "5672"))
RABBITMQ_USER = os.environ.get("LEASE_TEST_RABBITMQ_USER", "guest")
RABBITMQ_PASSWORD = os.environ.get("LEASE_TEST_RABBITMQ_PASSWORD", "guest")


def rabbitmq_url(vhost: str = "/") -> str:
    """The AMQP broker URL of ``vhost`` on the test RabbitMQ."""
    from urllib.parse import quote

    return (f"amqp://{RABBITMQ_USER}:{RABBITMQ_PASSWORD}@{RABBITMQ_HOST}:{RABBITMQ_PORT}/"
            f"{quote(vhost, safe='')}")


def rabbitmq_reachable(vhost: str = "/") -> tuple[bool, str]:
    """Can we open an AMQP connection (login included) to ``vhost``?"""
    import amqp

    try:
        connection = amqp.Connection(f"{RABBITMQ_HOST}:{RABBITMQ_PORT}", userid=RABBITMQ_USER,
                                     password=RABBITMQ_PASSWORD, virtual_host=vhost,
                                     connect_timeout=3)
        connection.connect()
        connection.close()
        return True, ""
    except Exception as exc:  # any failure means: not usable for the tests
        return False, f"amqp://{RABBITMQ_HOST}:{RABBITMQ_PORT}/ vhost {vhost!r}: {exc!r}"
