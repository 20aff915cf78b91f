"""The Django project with real ``celery worker`` processes, on SQLite, PostgreSQL (psycopg 3,
and psycopg2 for the payments) and MariaDB:
orders paid through a leased task that writes its models inside ``self.lease.atomic()``,
under a duplicate delivery, a stalled worker (SIGSTOP) and a killed one (SIGKILL); and
``delay_on_commit`` whose row is the outbox, with a producer killed right after its commit.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from lease_celery.stores.registry import shared_store
from tests.support.servers import REDIS_URL
from tests.support.workers import REPO, Journal, Worker, WorkerPool, client_app

APP = "tests.django_integration.project.celery_app"
TTL = 2.0


#: Each run: the alias, and the driver of Django's connection in the workers.
RUNS = {"sqlite": ("default", "sqlite3"), "postgres": ("pg", "psycopg"),
        "mariadb": ("my", "MySQLdb"), "postgres-psycopg2": ("pg", "psycopg2")}


@pytest.fixture(params=list(RUNS))
def shop(request: pytest.FixtureRequest, tmp_path: Path,
         django_project: dict[str, str]) -> Iterator[WorkerPool]:
    """Workers of the Django project on the store of this alias (django://ALIAS), their
    Django connection on this driver."""
    alias, driver = RUNS[request.param]
    run = uuid.uuid4().hex[:8]
    env = {**django_project, "LEASE_TEST_STORE": f"django://{alias}",
           "LEASE_TEST_QUEUE": f"lease-django-{run}", "LEASE_TEST_JOURNAL": f"journal-{run}",
           "LEASE_TEST_TTL": str(TTL), "LEASE_TEST_HEARTBEAT": "0.5"}
    if driver == "psycopg2":  # a project on psycopg2 (project/settings.py)
        env["LEASE_TEST_DJANGO_PSYCOPG2"] = "1"
    client = redis.Redis.from_url(REDIS_URL)
    pool = WorkerPool(tmp=tmp_path, env=env, journal=Journal(client, env["LEASE_TEST_JOURNAL"]))
    pool.client = client_app(REDIS_URL, env["LEASE_TEST_QUEUE"])
    pool.store_url = env["LEASE_TEST_STORE"]
    pool.driver = driver
    try:
        yield pool
    finally:
        pool.stop_all()
        client.delete(env["LEASE_TEST_JOURNAL"])


def alias_of(pool: WorkerPool) -> str:
    return pool.store_url.removeprefix("django://")


def orders(pool: WorkerPool, count: int) -> list[int]:
    from tests.django_integration.project.shop.models import Order

    prefix = uuid.uuid4().hex[:8]
    return [Order.objects.using(alias_of(pool)).create(number=f"{prefix}-{n}", amount=n).pk
            for n in range(count)]


def payments(pool: WorkerPool, order: int) -> list[int]:
    from tests.django_integration.project.shop.models import Payment

    return sorted(Payment.objects.using(alias_of(pool)).filter(order_id=order)
                  .values_list("token", flat=True))


def pay(pool: WorkerPool, order: int, stall: float = 0.0) -> Any:
    return pool.client.send_task("pay_order", args=(order,), kwargs={"stall": stall})


def started(pool: WorkerPool, order: int, *, count: int = 1) -> dict[str, Any]:
    pool.journal.wait_for(lambda j: len(j.events("started", order=order)) >= count,
                          timeout=30, what=f"order {order} started")
    event: dict[str, Any] = pool.journal.events("started", order=order)[count - 1]
    return event


def worker_of(pool: WorkerPool, pid: int) -> Worker:
    """The worker whose pool process ``pid`` is."""
    parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    return next(w for w in pool.workers if w.process.pid in (pid, parent))


def wait_paid(pool: WorkerPool, order: int, token: int) -> None:
    pool.journal.wait_for(lambda j: bool(j.events("paid", order=order, token=token)),
                          timeout=40, what=f"order {order} paid under token {token}")


def test_orders_are_paid_once_under_duplicates_stalls_and_kills(shop: WorkerPool) -> None:
    shop.start("a", concurrency=2, app=APP)
    shop.start("b", concurrency=2, app=APP)
    plain, duplicated, killed, stalled = orders(shop, 4)

    # A plain order and one delivered twice (two task ids, one key): one payment each.
    assert pay(shop, plain).get(timeout=30) == {"order": plain, "token": 1}
    first, second = pay(shop, duplicated, 1.0), pay(shop, duplicated)
    assert first.get(timeout=30) == second.get(timeout=30) == {"order": duplicated,
                                                                "token": 1}

    # A worker killed in the middle of a payment: its lease expires and the sweeper of the
    # surviving worker publishes the order again; it is paid once, under token 2.
    pay(shop, killed, 30.0)
    victim = worker_of(shop, started(shop, killed)["pid"])
    victim.kill()
    wait_paid(shop, killed, 2)
    shop.start("c", concurrency=2, app=APP)

    # A worker stalled (SIGSTOP) past its lease: the order is taken over and paid under
    # token 2; the stalled one wakes up, and its atomic() block rolls back with LeaseLost.
    pay(shop, stalled, 1.0)
    pid = started(shop, stalled)["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(TTL * 2)
        pay(shop, stalled)  # a redelivery, or the sweeper's: another worker takes over
        wait_paid(shop, stalled, 2)
    finally:
        os.kill(pid, signal.SIGCONT)
    shop.journal.wait_for(lambda j: bool(j.events("refused", order=stalled, token=1)),
                          timeout=30, what="the stalled worker's payment refused")

    for order in (plain, duplicated):
        assert payments(shop, order) == [1]
    for order in (killed, stalled):
        assert payments(shop, order) == [2]
        record = shared_store(shop.store_url).get(f"order:{order}")
        assert record is not None and record.result == {"order": order, "token": 2}
    assert {event["driver"] for event in shop.journal.events("paid")} == {shop.driver}


def test_delay_on_commit_writes_the_outbox_row_in_the_transaction(shop: WorkerPool) -> None:
    """Committed: published at once, runs once. Rolled back: no row, never runs. Committed
    by a producer killed before its publish: the sweeper publishes it from the row."""
    if shop.driver == "psycopg2":
        pytest.skip("on psycopg2: test_transactions.py's outbox test (Django's cursor)")
    shop.start("a", concurrency=2, app=APP)
    tag = uuid.uuid4().hex[:8]
    committed, rolled_back, killed = (f"{tag}-{what}" for what in ("ok", "rb", "kill"))
    env = {**os.environ, **shop.env,
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-m", "tests.django_integration.project.shop.producer",
         alias_of(shop), committed, rolled_back, killed],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == -signal.SIGKILL, done.stderr
    task_id = done.stdout.split()[0]
    shop.journal.wait_for(lambda j: bool(j.events("noted", number=killed)), timeout=40,
                          what="the killed producer's task, published from its row")
    time.sleep(3)  # past another sweep and grace: nothing more runs
    assert [e["number"] for e in shop.journal.events("noted") if e["number"] != killed] == [
        committed]
    assert len(shop.journal.events("noted", number=killed)) == 1
    store = shared_store(shop.store_url)
    assert store.get(f"note:{rolled_back}") is None
    record = store.get(f"note:{committed}")
    assert record is not None and record.task_id == task_id
