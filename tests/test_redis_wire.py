"""The Redis store's own script caller (lease_celery/stores/redis_wire.py) against a real server:
a lost script cache, killed connections, error replies and fork each leave the store correct."""

from __future__ import annotations

import os
import time
import uuid

import redis

from lease_celery.errors import StoreError
from lease_celery.stores.base import open_store


def _admin(url: str) -> redis.Redis:
    """A plain client on the store's server and database."""
    return redis.Redis.from_url(url.split("?")[0])


def _named(url: str, name: str) -> str:
    return f"{url}&client_name={name}"


def test_a_flushed_script_cache_is_loaded_again(redis_store_url: str) -> None:
    with open_store(redis_store_url) as store:
        assert store.claim("wire:1", owner="w", ttl=30) is not None
        # A server restart or SCRIPT FLUSH forgets every script.
        _admin(redis_store_url).script_flush()
        lease = store.claim("wire:2", owner="w", ttl=30)
        assert lease is not None and lease.token == 1
        assert store.finish(lease, {"ok": 1}) is True


def test_killed_connections_are_replaced_not_reused(redis_store_url: str) -> None:
    name = f"wire{uuid.uuid4().hex[:8]}"
    with open_store(_named(redis_store_url, name)) as store:
        assert store.claim("wire:warm", owner="w", ttl=30) is not None
        admin = _admin(redis_store_url)
        for _ in range(3):  # each time: the store's connection dies under it, idle
            killed = [c["id"] for c in admin.client_list() if c.get("name") == name]
            assert killed, "the store kept no connection of its own"
            for client_id in killed:
                admin.client_kill_filter(_id=client_id)
            lease = store.claim(f"wire:{uuid.uuid4().hex}", owner="w", ttl=30)
            assert lease is not None and lease.token == 1
            assert store.finish(lease, None) is True
            alive = {c["id"] for c in admin.client_list() if c.get("name") == name}
            assert alive and not alive & set(killed)


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
            assert lease is not None and lease.token == 1  # its own reply, not a stale one


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
            os.waitpid(pid, 0)
        with os.fdopen(read_end) as pipe:
            assert pipe.read() == "ok"
