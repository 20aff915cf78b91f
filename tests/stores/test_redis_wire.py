"""The Redis store's own script caller (lease_celery/stores/redis/wire.py) against a real server:
a lost script cache, killed connections, error replies and fork each leave the store correct."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
import uuid
from typing import Any

import pytest
import redis

from lease_celery.errors import StoreError
from lease_celery.stores.redis import wire as redis_wire
from lease_celery.stores.registry import open_store
from tests.support.servers import REDIS_STORE_URL
from tests.support.tokens import token_base


def _admin(url: str) -> redis.Redis:
    """A plain client on the store's server and database (every test store URL names
    REDIS_STORE_URL's, with a prefix of its own)."""
    assert url.startswith(REDIS_STORE_URL + "?"), url
    return redis.Redis.from_url(REDIS_STORE_URL)


def _named(url: str, name: str) -> str:
    return f"{url}&client_name={name}"


def test_a_flushed_script_cache_is_loaded_again(redis_store_url: str) -> None:
    with open_store(redis_store_url) as store:
        assert store.claim("wire:1", owner="w", ttl=30) is not None
        # A server restart or SCRIPT FLUSH forgets every script.
        _admin(redis_store_url).script_flush()
        lease = store.claim("wire:2", owner="w", ttl=30)
        assert lease is not None and lease.token == token_base(store) + 1
        assert store.finish(lease, {"ok": 1}) is True


def _idle_connections(store: Any, count: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Leave at least ``count`` idle connections in the store's script caller: calls from
    that many threads at once, each holding its connection until all have one.

    The store's epoch is opened first: a store object's first call opens it under a lock, one
    thread at a time, so ``count`` threads making the first calls could never all hold a
    connection at once."""
    store.epoch()
    barrier = threading.Barrier(count)
    real = redis_wire._evalsha

    def held(*args: Any) -> Any:
        reply = real(*args)
        barrier.wait(timeout=10)  # the connection is given back only once all have one
        return reply

    def claim(i: int) -> None:
        store.claim(f"wire:idle:{i}:{uuid.uuid4().hex}", owner="w", ttl=30)

    with monkeypatch.context() as patched:
        patched.setattr(redis_wire, "_evalsha", held)
        threads = [threading.Thread(target=claim, args=(i,)) for i in range(count)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=20)
    assert len(store._caller._idle) >= count  # precondition


def _kill(admin: redis.Redis, name: str) -> set[int]:
    killed = {c["id"] for c in admin.client_list() if c.get("name") == name}
    assert killed, "the store kept no connection of its own"
    for client_id in killed:
        admin.client_kill_filter(_id=client_id)
    return killed


def test_killed_idle_connections_are_replaced_not_reused(
        redis_store_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three idle connections die together (a server restart, an idle timeout): the next
    call's re-send goes out on a fresh connection, not on the next dead one, so it
    succeeds; the connections that replace them are new ones."""
    name = f"wire{uuid.uuid4().hex[:8]}"
    admin = _admin(redis_store_url)
    with open_store(_named(redis_store_url, name)) as store:
        for _ in range(2):
            _idle_connections(store, 3, monkeypatch)
            killed = _kill(admin, name)
            lease = store.claim(f"wire:{uuid.uuid4().hex}", owner="w", ttl=30)
            assert lease is not None and lease.token == token_base(store) + 1
            assert store.finish(lease, None) is True
            alive = {c["id"] for c in admin.client_list() if c.get("name") == name}
            assert alive and not alive & killed


def test_a_connection_idle_for_long_is_checked_before_use(
        redis_store_url: str, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A connection idle past CHECK_IDLE_AFTER is polled before it is used: one the server
    closed meanwhile is reconnected first, so the call does not even fail once (no
    "sending again")."""
    monkeypatch.setattr(redis_wire, "CHECK_IDLE_AFTER", 0.0)
    name = f"wire{uuid.uuid4().hex[:8]}"
    admin = _admin(redis_store_url)
    with open_store(_named(redis_store_url, name)) as store:
        assert store.claim("wire:warm", owner="w", ttl=30) is not None
        _kill(admin, name)
        time.sleep(0.1)  # the server's close has reached the client's socket
        with caplog.at_level(logging.WARNING, logger="lease_celery.stores.redis"):
            lease = store.claim(f"wire:{uuid.uuid4().hex}", owner="w", ttl=30)
        assert lease is not None and lease.token == token_base(store) + 1
        assert "sending again" not in caplog.text


def test_an_error_reply_leaves_the_next_call_in_step(redis_store_url: str) -> None:
    prefix = redis_store_url.split("prefix=")[1]
    # HMGET on a string: the script fails with WRONGTYPE.
    _admin(redis_store_url).set(f"{prefix}lease:wire:broken", "not a hash")
    with open_store(redis_store_url) as store:
        for _ in range(3):
            try:
                store.claim("wire:broken", owner="w", ttl=30)
            except StoreError as exc:
                assert "WRONGTYPE" in str(exc)
            else:
                raise AssertionError("a claim over a non-hash key did not fail")
            lease = store.claim(f"wire:{uuid.uuid4().hex}", owner="w", ttl=30)
            # Its own reply, not a stale one.
            assert lease is not None and lease.token == token_base(store) + 1


def test_a_forked_child_never_shares_the_parents_connections(redis_store_url: str) -> None:
    """Parent and child renew at once after the fork, from a store whose connection was open
    and idle before it, each with a ttl of its own: each gets its own deadlines. On one shared
    socket the replies would cross (the other's deadline, garbled replies)."""
    rounds = 300
    with open_store(redis_store_url) as store:
        mine = store.claim("wire:parent", owner="parent", ttl=30)
        theirs = store.claim("wire:child", owner="child", ttl=30)
        assert mine is not None and theirs is not None
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: report the first wrong answer, or "ok"
            os.close(read_end)
            verdict = "ok"
            try:
                for i in range(rounds):
                    renewed = store.renew(theirs, ttl=5000)
                    if renewed is None or not 4000 < renewed.expires_at - time.time() < 6000:
                        verdict = f"child renewal {i}: {renewed!r}"
                        break
            except BaseException as exc:
                verdict = f"child: {exc!r}"
            os.write(write_end, verdict.encode())
            os._exit(0)
        os.close(write_end)
        try:
            for _ in range(rounds):
                renewed = store.renew(mine, ttl=30)
                assert renewed is not None and 20 < renewed.expires_at - time.time() < 40
        finally:
            _reap(pid)
        with os.fdopen(read_end) as pipe:
            assert pipe.read() == "ok"


def _reap(pid: int, timeout: float = 30.0) -> None:
    """Wait for the child, and kill it past ``timeout``: a child stuck (a lock held at fork
    time) must fail the test, not hang the run."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.waitpid(pid, os.WNOHANG)[0]:
            return
        time.sleep(0.02)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    raise AssertionError(f"the forked child did not finish within {timeout}s")


def test_a_script_call_is_the_command_redis_py_would_send(redis_store_url: str) -> None:
    """The caller packs ``EVALSHA`` itself (hiredis, in C): the bytes are those redis-py's
    packer makes, for text that is not ASCII too; an argument hiredis does not take is
    redis-py's DataError, as before."""
    with open_store(redis_store_url) as store:
        pool = store._client.connection_pool  # type: ignore[attr-defined]
        connection = pool.connection_class(**pool.connection_kwargs)
        script = store._scripts["claim"]  # type: ignore[attr-defined]
        keys, args = ["lease:ключ:🙂", "token:k"], ["", "owner", 30, 1.5, '{"a": "ü"}']
        assert b"".join(redis_wire._packed(connection, script, keys, args)) == b"".join(
            connection.pack_command("EVALSHA", script.sha, 2, *keys, *args))
        with pytest.raises(redis.DataError):
            store._caller.run(script, [], [None])  # type: ignore[attr-defined]


def test_without_hiredis_the_store_packs_with_redis_py(
        redis_store_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """hiredis is optional: without it every script call goes through redis-py's packer, and
    an argument neither takes is redis-py's DataError."""
    monkeypatch.setattr(redis_wire, "_hiredis_pack", None)
    with open_store(redis_store_url) as store:
        lease = store.claim("wire:plain", owner="w", ttl=30)
        assert lease is not None and store.finish(lease, {"ok": 1})
        record = store.get("wire:plain")
        assert record is not None and record.result == {"ok": 1}
        caller = store._caller  # type: ignore[attr-defined]
        with pytest.raises(redis.DataError):
            caller.run(store._scripts["now"], [], [None])  # type: ignore[attr-defined]
