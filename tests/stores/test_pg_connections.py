"""The PostgreSQL store's connections (lease_celery/stores/pg_connections.py), on the real server:
reused while healthy, never reused in a state other than the one they were taken in, bounded
by ``pool_max``, and replaced when the server closed them while idle."""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

import psycopg
import pytest

from lease_celery import open_store
from lease_celery.stores import connection_list, pg_connections
from lease_celery.stores.pg_connections import Connections, NoConnection
from tests.support.servers import PG_DSN


def _backend(conn: psycopg.Connection[Any]) -> int:
    row = conn.execute("SELECT pg_backend_pid()").fetchone()
    assert row is not None
    return int(row[0])


def test_a_connection_given_back_is_the_next_one_taken() -> None:
    """The hot path's point: a statement after a statement runs on the same backend, no
    connect in between."""
    connections = Connections(PG_DSN, max_size=2)
    try:
        conn = connections.take(1.0)
        first = _backend(conn)
        connections.give_back(conn)
        conn = connections.take(1.0)
        assert _backend(conn) == first
        connections.give_back(conn)
    finally:
        connections.close()


def test_a_connection_left_in_a_transaction_is_closed_not_reused() -> None:
    """A caller that gives back a connection with a transaction open (an error between BEGIN
    and COMMIT) must not hand the next caller its uncommitted writes: it is closed."""
    connections = Connections(PG_DSN, max_size=2)
    try:
        conn = connections.take(1.0)
        conn.execute("BEGIN")
        first = _backend(conn)
        connections.give_back(conn)
        assert conn.closed
        conn = connections.take(1.0)
        assert _backend(conn) != first
        connections.give_back(conn)
    finally:
        connections.close()


def test_a_broken_connection_closes_the_idle_ones_too() -> None:
    """A connection error most likely killed its idle siblings (a server restart): none of
    them is handed out after it."""
    connections = Connections(PG_DSN, max_size=3)
    try:
        held = [connections.take(1.0) for _ in range(2)]
        for conn in held[1:]:
            connections.give_back(conn)
        idle = held[1]
        connections.give_back(held[0], broken=True)
        assert held[0].closed and idle.closed
    finally:
        connections.close()


def test_pool_max_bounds_the_connections_in_use() -> None:
    """With ``max_size`` taken, the next caller waits, then hears ``NoConnection``; one given
    back in time is handed to it."""
    connections = Connections(PG_DSN, max_size=1)
    try:
        conn = connections.take(1.0)
        started = time.monotonic()
        with pytest.raises(NoConnection):
            connections.take(0.2)
        assert time.monotonic() - started >= 0.2
        threading.Timer(0.1, connections.give_back, args=(conn,)).start()
        again = connections.take(5.0)
        assert again is conn
        connections.give_back(again)
    finally:
        connections.close()


def test_an_idle_connection_the_server_closed_is_replaced_without_an_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A backend terminated while its connection sat idle (the server's idle timeout, a
    restart) is noticed before use, and the statement runs on a new one: no error, no retry."""
    monkeypatch.setattr(connection_list, "CHECK_IDLE_AFTER", 0.0)
    connections = Connections(PG_DSN, max_size=2)
    try:
        conn = connections.take(1.0)
        victim = _backend(conn)
        connections.give_back(conn)
        with psycopg.connect(PG_DSN, autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(%s, 5000)", (victim,))
        deadline = time.monotonic() + 5
        while not pg_connections._closed_by_server(conn) and time.monotonic() < deadline:
            time.sleep(0.01)
        fresh = connections.take(1.0)
        assert _backend(fresh) != victim
        connections.give_back(fresh)
    finally:
        connections.close()


def test_the_store_runs_on_its_first_connection_and_keeps_one_per_thread_in_use(
        postgres_url: str) -> None:
    """The store's first statement reuses the connection that created the schema; two threads
    claiming at once each use a connection of their own, and both are kept for the next."""
    app = f"lease_test_{uuid.uuid4().hex[:8]}"
    with open_store(f"{postgres_url}&application_name={app}") as store:
        assert store.claim("k0", owner="w", ttl=10) is not None
        with psycopg.connect(PG_DSN, autocommit=True) as admin:
            count = admin.execute("SELECT count(*) FROM pg_stat_activity WHERE "
                                  "application_name = %s", (app,)).fetchone()
        assert count == (1,)
        barrier = threading.Barrier(2)

        def claim(key: str) -> None:
            barrier.wait()
            for i in range(20):
                store.claim(f"{key}:{i}", owner="w", ttl=10)

        threads = [threading.Thread(target=claim, args=(name,)) for name in ("a", "b")]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        idle = store._get_connections()._idle  # type: ignore[attr-defined]
        assert 1 <= len(idle) <= 2


def test_a_healthy_idle_connection_above_descriptor_1024_is_kept(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A busy worker may hold more than 1,024 descriptors; ``select()`` cannot look at one
    above that, and an idle check that fails on it would throw a healthy connection away
    (and connect again) every time: a connection made there is kept and reused."""
    import os
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 2048:
        pytest.skip(f"this process may open at most {hard} descriptors")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 2048), hard))
    monkeypatch.setattr(connection_list, "CHECK_IDLE_AFTER", 0.0)
    pipes = [os.pipe() for _ in range(520)]  # 1,040 descriptors
    connections = Connections(PG_DSN, max_size=1)
    try:
        conn = connections.take(1.0)
        assert conn.fileno() > 1024
        first = _backend(conn)
        connections.give_back(conn)
        again = connections.take(1.0)
        assert again is conn and _backend(again) == first
        connections.give_back(again)
    finally:
        connections.close()
        for read, write in pipes:
            os.close(read)
            os.close(write)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
