"""``django://`` stores in the threads and processes the library uses: many threads share
the store's own small pool (no Django connection is opened per thread, so none is left open
when a thread ends), and a forked child makes connections of its own."""

from __future__ import annotations

import os
import threading
import uuid

import pytest

from lease_celery import open_store

pytestmark = pytest.mark.usefixtures("django_project")


@pytest.mark.parametrize("alias", ["default", "pg"])
def test_many_threads_share_the_stores_pool_and_open_no_django_connection(
        alias: str) -> None:
    from django.db import connections

    store = open_store(f"django://{alias}?pool_max=3" if alias == "pg"
                       else f"django://{alias}")
    errors: list[BaseException] = []
    opened: list[bool] = []
    prefix = f"threads-{uuid.uuid4().hex[:6]}"

    def work(n: int) -> None:
        try:
            for i in range(15):
                lease = store.claim(f"{prefix}:{n}:{i}", owner=f"t{n}", ttl=30)
                assert lease is not None
                renewed = store.renew(lease, ttl=30)
                assert renewed is not None
                assert store.finish(renewed, {"n": n, "i": i})
            # This thread's own Django connection for the alias was never opened.
            opened.append(connections[alias].connection is not None)
        except BaseException as exc:
            errors.append(exc)

    def backends() -> int:
        with connections["pg"].cursor() as cursor:
            cursor.execute("SELECT count(*) FROM pg_stat_activity "
                           "WHERE datname = current_database() AND pid <> pg_backend_pid()")
            (count,) = cursor.fetchone()
            return int(count)

    before = backends() if alias == "pg" else 0  # other stores' pools of this process
    threads = [threading.Thread(target=work, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert errors == []
    assert opened == [False] * 8
    if alias == "pg":  # the store's pool_max, whatever the number of threads
        assert backends() - before <= 3
    store.close()


@pytest.mark.parametrize("alias", ["default", "pg", "my"])
def test_a_forked_child_uses_connections_of_its_own(alias: str) -> None:
    store = open_store(f"django://{alias}")
    key = f"fork-{uuid.uuid4().hex[:6]}"
    assert store.claim(key + ":parent", owner="parent", ttl=30) is not None  # connected
    pid = os.fork()
    if pid == 0:  # the child: the parent's connections are never used here
        code = 1
        try:
            lease = store.claim(key + ":child", owner="child", ttl=30)
            code = 0 if lease is not None and store.finish(lease, "child") else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    record = store.get(key + ":child")
    assert record is not None and record.result == "child"
    assert store.get(key + ":parent") is not None  # the parent's connection still works
    store.close()


def test_a_serializable_projects_store_still_runs_its_transactions_read_committed() -> None:
    """OPTIONS["isolation_level"] is for the project's own transactions: the store's (a
    fenced block here) are READ COMMITTED, as its statements are written for."""
    store = open_store("django://pg_serializable")
    lease = store.claim(f"isolation-{uuid.uuid4().hex[:6]}", owner="me", ttl=30)
    assert lease is not None
    with store.fenced(lease) as conn:
        (level,) = conn.execute("SHOW transaction_isolation").fetchone()
    assert level == "read committed"
    store.close()
