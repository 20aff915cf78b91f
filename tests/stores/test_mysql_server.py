"""The MySQL store and its server: connections killed, a fork, a server that is not there, a
wrong password or database. Each error names the problem and the server (never the
password), with PyMySQL's exception as its cause."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator

import pymysql
import pytest

from lease_celery import LeaseState, Store, StoreError, open_store
from tests.support.mysql_databases import server_connection


@pytest.fixture
def store(mysql_url: str) -> Iterator[Store]:
    with open_store(mysql_url) as opened:
        yield opened


def _kill_connections(store: Store) -> int:
    conn = server_connection()
    killed = 0
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT id FROM information_schema.processlist "
                        "WHERE db = %s AND id <> CONNECTION_ID()",
                        (store.database,))  # type: ignore[attr-defined]
            for (found,) in cur.fetchall():
                cur.execute(f"KILL CONNECTION {int(found)}")
                killed += 1
    finally:
        conn.close()
    return killed


def test_the_store_reconnects_after_its_connections_are_killed(store: Store) -> None:
    """The server kills every connection of the store between two calls: the next claim,
    finish and read go through on new connections, and nothing is lost or doubled."""
    lease = store.claim("k", owner="w", ttl=30)
    assert lease is not None
    assert _kill_connections(store) >= 1
    assert store.finish(lease, "ok") is True
    assert _kill_connections(store) >= 1
    record = store.get("k")
    assert record is not None and (record.state, record.token) == (LeaseState.DONE, 1)
    assert [e.event for e in store.history("k")] == ["claimed", "finished"]


def test_a_forked_child_makes_its_own_connections(store: Store) -> None:
    """After fork() the child never uses the parent's connections (one socket used by two
    processes crosses their answers): it claims on its own, and the parent's connections
    still answer the parent afterwards."""
    assert store.claim("parent", owner="p", ttl=30) is not None
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            lease = store.claim("child", owner="c", ttl=30)
            code = 0 if lease is not None and store.finish(lease, "child") else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    record = store.get("child")
    assert record is not None and record.result == "child"
    assert store.get("parent") is not None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def test_nothing_listening_fails_fast_naming_host_and_port() -> None:
    port = _free_port()
    with open_store(f"mysql://root:secret@127.0.0.1:{port}/leases?reconnect_timeout=0.5"
                    ) as store, pytest.raises(StoreError) as caught:
        store.get("k")
    assert f"127.0.0.1:{port}" in str(caught.value)
    assert "secret" not in str(caught.value)
    assert isinstance(caught.value.__cause__, pymysql.Error)


def test_wrong_credentials_and_missing_database_are_named(mysql_url: str) -> None:
    host = mysql_url.split("@", 1)[1].rsplit("/", 1)[0]
    with open_store(f"mysql://nobody:wrong@{host}/test") as store, \
            pytest.raises(StoreError, match=r"Access denied") as caught:
        store.get("k")
    assert "wrong" not in str(caught.value).replace("Access denied", "")
    with open_store(f"mysql://root@{host}/lease_no_such_database") as store, \
            pytest.raises(StoreError, match=r"Unknown database 'lease_no_such_database'"):
        store.get("k")


def test_a_url_without_a_database_is_refused_before_connecting() -> None:
    for url in ("mysql://root@127.0.0.1:1", "mysql://root@127.0.0.1:1/"):
        with pytest.raises(ValueError, match="must name one database"):
            open_store(url)
