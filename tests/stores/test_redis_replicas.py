"""``?wait_replicas=N``: the Redis store answers a claim, an outcome or a receipt only once N
replicas acknowledged it (Redis ``WAIT``), and says so when they did not.

A primary and a replica of the test's own (tests/support/private_redis.py); the replica is
frozen with SIGSTOP to play one that lags.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from lease_celery import ConfigError, StoreError, open_store
from tests.support.private_redis import DURABLE, PrivateRedis


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[tuple[PrivateRedis, PrivateRedis]]:
    primary = PrivateRedis(tmp_path / "primary", *DURABLE)
    primary.start()
    replica = PrivateRedis(tmp_path / "replica", "--replicaof", "127.0.0.1", str(primary.port))
    replica.start()
    try:
        client = redis.Redis(port=primary.port, decode_responses=True)
        deadline = time.monotonic() + 10
        while (client.info("replication").get("slave0") or {}).get("state") != "online":
            assert time.monotonic() < deadline, "the replica did not come online"
            time.sleep(0.05)
        yield primary, replica
    finally:
        replica.stop()
        primary.stop()


def test_writes_wait_for_the_replica_and_a_lagging_one_is_named(
        pair: tuple[PrivateRedis, PrivateRedis]) -> None:
    primary, replica = pair
    # 2 s: under a loaded machine (three test processes on two cores) a replica that is
    # keeping up took over 0.3 s to acknowledge the first write (the epoch's).
    waiting = open_store(primary.url("w:") + "&wait_replicas=1&wait_timeout=2")
    plain = open_store(primary.url("p:"))
    lease = waiting.claim("k", owner="w1", ttl=30)
    assert lease is not None
    # WAIT returned: the replica holds the claim already.
    on_replica = redis.Redis(port=replica.port, decode_responses=True)
    assert on_replica.hmget("w:lease:k", "owner", "token") == ["w1", str(lease.token)]
    assert waiting.finish(lease, {"ok": 1})

    assert replica.server is not None
    os.kill(replica.server.pid, signal.SIGSTOP)  # a replica that stopped keeping up
    try:
        # Without the option the claim is answered at once, replica or not ...
        assert plain.claim("k", owner="w1", ttl=30) is not None
        # ... with it, the store says what happened instead of answering as if it were safe.
        with pytest.raises(StoreError, match="claim reached the primary, but 0 of the 1 "
                                             "replicas wait_replicas asks for acknowledged"):
            waiting.claim("j", owner="w1", ttl=30)
        # What reached the primary is there: the key is held (until its ttl), not granted twice.
        with open_store(primary.url("w:")) as unwaiting:
            record = unwaiting.get("j")
            assert record is not None and record.owner == "w1"
            assert unwaiting.claim("j", owner="w2", ttl=30) is None
    finally:
        os.kill(replica.server.pid, signal.SIGCONT)
    again = waiting.claim("i", owner="w1", ttl=30)
    assert again is not None
    waiting.close()
    plain.close()


@pytest.mark.parametrize(("query", "words"), [
    ("wait_replicas=0", "wait_replicas='0' must be a whole number >= 1"),
    ("wait_replicas=one", "wait_replicas='one' must be a whole number >= 1"),
    ("wait_timeout=1", "wait_timeout only applies with wait_replicas=N"),
    ("wait_replicas=1&wait_timeout=-1", "wait_timeout"),
])
def test_bad_wait_options_are_named(query: str, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        open_store(f"redis://127.0.0.1:6379/0?{query}")
