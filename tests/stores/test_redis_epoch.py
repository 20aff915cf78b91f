"""The Redis store's epoch: a server that lost the store's data is caught, nothing is granted
until an operator accepts the loss, and tokens and fence numbers never go back.

Each test runs a redis-server of its own (tests/support/private_redis.py), restarted for real:
without persistence it comes back empty, as a crashed or restarted production Redis without an
AOF does.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from lease_celery import FenceGate, StaleFence, StoreDataLost
from lease_celery.cli import RESET_EPOCH_RISKS
from lease_celery.doctor import diagnose
from lease_celery.stores.redis import RedisStore
from tests.stores.test_doctor import make_app
from tests.support.policy_helpers import cli_env, parse_json, run_cli
from tests.support.private_redis import DURABLE, PrivateRedis


@pytest.fixture
def server(tmp_path: Path) -> Iterator[PrivateRedis]:
    """A redis-server without persistence: a restart loses everything."""
    private = PrivateRedis(tmp_path / "redis")
    private.start()
    yield private
    private.stop()


def opened(server: PrivateRedis) -> RedisStore:
    return RedisStore(server.url())


def test_a_new_store_opens_without_a_step_and_counts_from_its_creation(
        server: PrivateRedis) -> None:
    store = opened(server)
    lease = store.claim("report:1", owner="w1", ttl=10)
    assert lease is not None
    epoch = store.epoch()
    now_us = store.now() * 1_000_000
    # The floor is the creation time in microseconds: every number is above it, one apart.
    assert now_us - 60_000_000 < epoch.floor <= now_us
    assert lease.token == epoch.floor + 1 and lease.fence == epoch.floor + 1
    again = store.claim("report:2", owner="w1", ttl=10)
    assert again is not None and again.token == epoch.floor + 1
    assert again.fence == lease.fence + 1
    # The history shows the numbers whole (Lua would write 1.79e+15).
    assert [e.token for e in store.history("report:1")] == [lease.token]
    # A second process on the same store works in the same epoch.
    other = opened(server)
    assert other.epoch() == epoch
    assert other.renew(lease, ttl=10) is not None


def test_a_restart_without_persistence_is_refused_until_an_operator_resets_the_epoch(
        server: PrivateRedis, tmp_path: Path) -> None:
    worker = opened(server)
    held = worker.claim("invoice:7", owner="w1", ttl=30)
    assert held is not None
    # An outside resource that outlives the store's data: it has seen held's fence.
    resource = sqlite3.connect(tmp_path / "resource.db", isolation_level=None)
    gate = FenceGate(resource)
    gate.write("ledger", held.fence, lambda conn: None)

    server.restart()  # no AOF: the server comes back empty

    # The live owner's next renewal is refused, not answered "lost" as if another took it...
    with pytest.raises(StoreDataLost, match=r"lost its data.*reset-epoch --accept-data-loss"):
        worker.renew(held, ttl=30)
    # ... and so is every other process, one that never saw the store before included: the
    # first to notice marked the record lost.
    newcomer = opened(server)
    with pytest.raises(StoreDataLost, match=r"the epoch record .* is gone"):
        newcomer.claim("invoice:7", owner="w2", ttl=30)
    with pytest.raises(StoreDataLost):
        worker.claim("invoice:8", owner="w1", ttl=30)

    # doctor names it as an error, and how to go on.
    found = {f.code: f for f in diagnose(make_app(server.url()))}
    assert found["store.data_lost"].severity == "error"
    assert "reset-epoch --accept-data-loss" in found["store.data_lost"].message

    # The operator resets: without the flag nothing happens, and the refusal says what may
    # run twice.
    env = cli_env(server.url())
    refused = run_cli(["reset-epoch"], env=env, cwd=tmp_path)
    assert refused.returncode == 2, refused.stderr
    assert "--accept-data-loss" in refused.stderr and "may run again" in refused.stderr
    with pytest.raises(StoreDataLost):
        newcomer.claim("invoice:7", owner="w2", ttl=30)
    reset = run_cli(["reset-epoch", "--accept-data-loss", "--json"], env=env, cwd=tmp_path)
    assert reset.returncode == 0, reset.stderr
    answer = parse_json(reset)
    assert answer["lost"].startswith("the epoch record") and answer["replaced"] is None
    assert answer["may_run_twice"] == RESET_EPOCH_RISKS

    # Granted again, with numbers above everything handed out before the loss: the resource
    # that outlived it accepts the new holder and then refuses the old one.
    taken = newcomer.claim("invoice:7", owner="w2", ttl=30)
    assert taken is not None
    assert taken.token > held.token and taken.fence > held.fence
    assert taken.token > answer["floor"]
    gate.write("ledger", taken.fence, lambda conn: None)
    with pytest.raises(StaleFence):
        gate.write("ledger", held.fence, lambda conn: None)
    # The old owner's store object takes up the new epoch; its lease is gone.
    assert worker.renew(held, ttl=30) is None
    assert not worker.finish(held, "late")
    assert worker.epoch().id == answer["epoch"]


def test_a_durable_restart_keeps_the_epoch_and_the_leases(tmp_path: Path) -> None:
    server = PrivateRedis(tmp_path / "durable", *DURABLE)
    server.start()
    try:
        store = opened(server)
        held = store.claim("k", owner="w1", ttl=30)
        assert held is not None
        server.restart()
        assert store.renew(held, ttl=30) is not None
        assert opened(server).epoch() == store.epoch()
    finally:
        server.stop()


def test_an_epoch_created_on_the_emptied_store_is_refused_too(server: PrivateRedis) -> None:
    """A process that opens the emptied store first writes a new epoch (it cannot know): the
    first process that saw the old one marks the store lost, for both."""
    old = opened(server)
    held = old.claim("k", owner="w1", ttl=30)
    assert held is not None
    redis.Redis(port=server.port).flushall()
    fresh = opened(server)
    taken = fresh.claim("k", owner="w2", ttl=30)
    # Even in that window, the numbers are above the old ones.
    assert taken is not None and taken.token > held.token and taken.fence > held.fence
    with pytest.raises(StoreDataLost, match=r"was replaced by .* created on an empty store"):
        old.renew(held, ttl=30)
    with pytest.raises(StoreDataLost):
        fresh.renew(taken, ttl=30)


def test_data_without_an_epoch_record_is_refused(server: PrivateRedis) -> None:
    store = opened(server)
    assert store.claim("k", owner="w1", ttl=30) is not None
    client = redis.Redis(port=server.port)
    client.delete("private:epoch")
    with pytest.raises(StoreDataLost, match=r"holds data .* but no epoch record"):
        opened(server).claim("j", owner="w2", ttl=30)


def test_a_reset_without_a_loss_is_taken_up_by_open_stores(server: PrivateRedis) -> None:
    running = opened(server)
    held = running.claim("k", owner="w1", ttl=30)
    assert held is not None
    before = running.epoch()
    done = opened(server).reset_epoch()
    assert done.replaced == before.id and done.lost is None
    assert done.epoch.floor > before.floor
    # The record survived, so the lease did: the running store goes on in the new epoch.
    renewed = running.renew(held, ttl=30)
    assert renewed is not None and running.epoch() == done.epoch
    assert running.finish(held, "ok")
    again = running.claim("j", owner="w1", ttl=30)
    assert again is not None and again.fence > done.epoch.floor > held.fence


def test_stores_without_an_epoch_say_so(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'leases.db'}"
    proc = run_cli(["reset-epoch", "--accept-data-loss"], env=cli_env(url), cwd=tmp_path)
    assert proc.returncode == 1
    assert "keeps no epoch" in proc.stderr
