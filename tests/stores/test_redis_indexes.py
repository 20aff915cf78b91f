"""The Redis store's state indexes (issue 23): operator reads that do not SCAN.

Every transition script keeps one sorted set of lease hashes per state (by ``updated_at``, the
order ``find`` lists in), one of the running hashes by ``expires_at`` (what ``stats`` counts
as expired) and one of effect receipts per state; ``stats``, ``find`` and ``effects.find``
read those, never SCAN. A prefix the previous version wrote (no indexes) has them built once,
in batches, while workers go on writing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
import redis

from lease_celery import EffectState, Lease, LeaseState, LimitRefused, open_store
from lease_celery.limits import GroupLimit
from lease_celery.stores.redis import store as redis_store
from lease_celery.stores.redis.store import RedisStore
from lease_celery.testing import ManualClock
from tests.support.servers import REDIS_STORE_URL

LEASE_STATES = [state.value for state in LeaseState]
EFFECT_STATES = [state.value for state in EffectState]
TASK = {"name": "proj.job", "args": [], "kwargs": {}, "options": {"task_id": "t-1"}}


def prefix_of(url: str) -> str:
    return parse_qs(urlsplit(url).query)["prefix"][0]


@pytest.fixture
def client(redis_store_url: str) -> Iterator[redis.Redis]:
    raw = redis.Redis.from_url(REDIS_STORE_URL, decode_responses=True)
    yield raw
    raw.close()


@pytest.fixture
def sent(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the commands redis-py sends outside scripts (pipelines included)."""
    names: list[str] = []
    direct = redis.Redis.execute_command
    piped = redis.client.Pipeline.pipeline_execute_command

    def execute(self: Any, *args: Any, **options: Any) -> Any:
        names.append(str(args[0]).upper())
        return direct(self, *args, **options)

    def pipeline(self: Any, *args: Any, **options: Any) -> Any:
        names.append(str(args[0]).upper())
        return piped(self, *args, **options)

    monkeypatch.setattr(redis.Redis, "execute_command", execute)
    monkeypatch.setattr(redis.client.Pipeline, "pipeline_execute_command", pipeline)
    return names


def scan(client: redis.Redis, head: str) -> list[str]:
    return sorted(str(name) for name in client.scan_iter(match=f"{head}*", count=1000))


def reference_rows(client: redis.Redis, prefix: str) -> list[dict[str, str]]:
    """Every lease row, read the slow way (what find() and stats() must agree with)."""
    head = f"{prefix}lease:"
    return [{"key": name[len(head):], **client.hgetall(name)} for name in scan(client, head)]


def assert_indexed(client: redis.Redis, prefix: str, store: RedisStore) -> None:
    """Each hash is in the index of its state (score: updated_at) and in no other; the running
    ones in the expiry index (score: expires_at); no index holds anything else; the operator
    reads answer what a SCAN of every row answers."""
    head = f"{prefix}lease:"
    hashes = scan(client, head)
    for state in LEASE_STATES:
        members = dict(client.zrange(f"{prefix}index:lease:{state}", 0, -1, withscores=True))
        expected = {name: float(client.hget(name, "updated_at") or "nan") for name in hashes
                    if client.hget(name, "state") == state}
        assert members == expected, state
    expiry = dict(client.zrange(f"{prefix}index:lease:expiry", 0, -1, withscores=True))
    assert expiry == {name: float(client.hget(name, "expires_at") or "nan") for name in hashes
                      if client.hget(name, "state") == "running"}
    receipts = scan(client, f"{prefix}effect:")
    for state in EFFECT_STATES:
        members = dict(client.zrange(f"{prefix}index:effect:{state}", 0, -1, withscores=True))
        assert members == {name: float(client.hget(name, "updated_at") or "nan")
                           for name in receipts if client.hget(name, "state") == state}, state
    assert not client.exists(f"{prefix}terminal"), "the terminal index is the done/dead ones now"
    # The reads, against the slow way.
    rows = reference_rows(client, prefix)
    now = store.now()
    counts: dict[str, int] = {}
    for row in rows:
        counts[row["state"]] = counts.get(row["state"], 0) + 1
    stats = store.stats()
    assert stats.counts == counts
    assert stats.expired == sum(row["state"] == "running" and float(row["expires_at"]) <= now
                                for row in rows)
    for state in [None, *LeaseState]:
        found = store.find(state=state, limit=1000)
        wanted = [row for row in rows if state is None or row["state"] == state.value]
        assert sorted(r.key for r in found) == sorted(row["key"] for row in wanted), state
        times = [r.updated_at or 0.0 for r in found]
        assert times == sorted(times, reverse=True), state
        limited = store.find(state=state, limit=2)
        assert [r.updated_at for r in limited] == times[:2], state
    for effect_state in [None, *EffectState]:
        receipts_found = store.effect_find(state=effect_state, limit=1000)
        assert sorted(r.key for r in receipts_found) == sorted(
            name[len(f"{prefix}effect:"):] for name in receipts
            if effect_state is None or client.hget(name, "state") == effect_state.value)


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(1000.0)


@pytest.fixture
def store(redis_store_url: str, clock: ManualClock) -> Iterator[RedisStore]:
    with open_store(redis_store_url, clock=clock) as opened:
        assert isinstance(opened, RedisStore)
        yield opened


def populate(store: RedisStore, clock: ManualClock) -> None:
    """Rows in every state, and receipts."""
    for i in range(12):
        lease = store.claim(f"done:{i}", owner="w", ttl=10)
        assert lease is not None and store.finish(lease, {"i": i})
        clock.advance(1)
    for i in range(4):
        assert store.claim(f"running:{i}", owner="w", ttl=6 + 3 * i, task=TASK)
        clock.advance(1)
    for i in range(3):
        lease = store.claim(f"dead:{i}", owner="w", ttl=10)
        assert lease is not None and store.kill(lease, reason="boom")
        clock.advance(1)
    for i in range(2):
        lease = store.claim(f"ready:{i}", owner="w", ttl=10)
        assert lease is not None and store.release(lease)
        clock.advance(1)
    store.effects.once("effect:a", {"p": 1}, lambda key: "sent")
    store.effect_insert("effect:b", "f" * 64, None)


def test_stats_and_find_on_redis_send_no_scan(store: RedisStore, clock: ManualClock,
                                              client: redis.Redis, sent: list[str]) -> None:
    """stats() costs a command per state, find(state, limit=N) reads N rows: no SCAN (the
    issue: 10.6 s for stats() and 10.9 s for find() at 100,000 keys, walking every key)."""
    populate(store, clock)
    clock.advance(2)  # two of the running leases expire
    sent.clear()
    stats = store.stats()
    assert stats.counts == {"done": 12, "running": 4, "dead": 3, "ready": 2}
    assert stats.expired == 2
    running = store.find(state=LeaseState.RUNNING, limit=2)
    assert [r.key for r in running] == ["running:3", "running:2"]
    assert [r.key for r in store.find(limit=3)] == ["ready:1", "ready:0", "dead:2"]
    assert [r.key for r in store.find(state=LeaseState.DEAD, limit=10)] == [
        "dead:2", "dead:1", "dead:0"]
    assert [r.key for r in store.effects.find(state=EffectState.IN_FLIGHT)] == ["effect:b"]
    assert "SCAN" not in sent and "KEYS" not in sent, sent
    # O(N): a find of 2 rows reads 2 hashes, however many rows the state holds.
    sent.clear()
    assert len(store.find(state=LeaseState.DONE, limit=2)) == 2
    assert sent.count("HGETALL") == 2, sent
    assert_indexed(client, prefix_of(store.url), store)


def test_the_indexes_follow_every_transition(store: RedisStore, clock: ManualClock,
                                             client: redis.Redis, redis_store_url: str) -> None:
    """After each transition of each script the indexes are exactly the rows' states and
    times, and the reads answer what a SCAN of every row answers."""
    prefix = prefix_of(redis_store_url)

    def step(action: Callable[[], Any]) -> Any:
        clock.advance(1)
        answer = action()
        assert_indexed(client, prefix, store)
        return answer

    lease = step(lambda: store.claim("k1", owner="w", ttl=10, task=TASK))  # claim
    lease = step(lambda: store.renew(lease, ttl=20))  # renew
    assert step(lambda: store.checkpoint(lease, '{"at": 1}'))  # checkpoint
    assert step(lambda: store.finish(lease, "r", settle_within=5))  # done, settling
    clock.advance(1)
    assert step(lambda: store.renew(lease, ttl=5))  # the settle phase renewed
    assert step(lambda: store.settle_many([lease])) == [True]  # settled
    lease2 = step(lambda: store.claim("k2", owner="w", ttl=2, task=TASK))
    clock.advance(3)
    lease2b = step(lambda: store.claim("k2", owner="w2", ttl=10, task=TASK))  # a takeover
    assert step(lambda: store.release(lease2b, delay=30, reason="later"))  # ready, backing off
    assert lease2 is not None
    lease3 = step(lambda: store.claim("k3", owner="w", ttl=10, task=TASK))
    assert step(lambda: store.kill(lease3, reason="nope", settle_within=5))  # dead, settling
    clock.advance(10)
    completer = step(lambda: store.claim_settlement("k3", owner="w3", ttl=10))
    assert completer is not None and step(lambda: store.settle(completer))
    assert step(lambda: store.requeue("k3", reason="again")) is not None  # dead -> ready
    lease4 = step(lambda: store.claim("k4", owner="w", ttl=10, task=TASK))
    assert step(lambda: store.cancel("k4", reason="stop"))  # a live holder: asked to stop
    assert step(lambda: store.force_release("k4", reason="op"))  # running -> ready
    assert step(lambda: store.cancel("k4", reason="stop"))  # ready -> dead
    assert step(lambda: store.cancel("never-seen", reason="stop"))  # no row -> dead
    assert lease4 is not None
    assert step(lambda: store.record_published("k5", task=TASK, countdown=0))  # ready, new
    step(lambda: store.claim("k6", owner="w", ttl=1, task=TASK))
    clock.advance(200)
    swept = step(lambda: store.sweep_expired(limit=10, grace=60))  # marks, no state change
    assert {r.key for r in swept} >= {"k5", "k6"}
    for record in swept:
        step(lambda record=record: store.sweep_unmark(record.key, record.token))
    assert step(lambda: store.purge("k2"))  # purge
    for i in range(3):
        lease = step(lambda i=i: store.claim(f"old:{i}", owner="w", ttl=10))
        assert step(lambda lease=lease, i=i: store.finish(lease, i))
    clock.advance(100)
    ended = sorted((float(row["updated_at"]), row["key"]) for row in reference_rows(client, prefix)
                   if row["state"] in ("done", "dead") and row.get("settling") != "1")
    assert len(ended) > 3
    assert step(lambda: store.purge_older_than(50, limit=2)) == 2  # retention, oldest first
    assert [store.get(key) is None for _, key in ended] == [True, True] + [False] * (
        len(ended) - 2)
    assert step(lambda: store.purge_older_than(50)) >= 1  # an operator's purge of all
    # Limited claims: a slot granted, a claim refused and parked, handed on.
    group = GroupLimit("g", limit=1)
    granted = step(lambda: store.claim_limited("l1", owner="w", ttl=10, limit=group, task=TASK))
    assert isinstance(granted, Lease)
    refused = step(lambda: store.claim_limited("l2", owner="w", ttl=10, limit=group, task=TASK))
    assert isinstance(refused, LimitRefused) and refused.parked
    assert step(lambda: store.finish(granted, "ok"))
    assert [h.key for h in step(lambda: store.hand_on("g", grace=0))] == ["l2"]
    # Receipts: inserted, done, restarted, needs reconciliation, deleted.
    assert step(lambda: store.effect_insert("e1", "a" * 64, None))
    receipt = store.effect_get("e1")
    assert receipt is not None
    assert step(lambda: store.effect_update("e1", version=receipt.version,
                                            state=EffectState.DONE, result="1"))
    assert step(lambda: store.effect_restart("e1", version=receipt.version + 1, lease=None))
    assert step(lambda: store.effect_update("e1", version=receipt.version + 2,
                                            state=EffectState.NEEDS_RECONCILIATION,
                                            result=None))
    assert step(lambda: store.effect_delete("e1", version=receipt.version + 3))


def make_legacy(client: redis.Redis, prefix: str) -> None:
    """Turn a prefix into what the previous version left: the same hashes, no state indexes,
    no ``indexed`` mark on the epoch record, and its terminal index of the settled done/dead
    hashes by when they ended."""
    for name in scan(client, f"{prefix}index:"):
        client.delete(name)
    client.hdel(f"{prefix}epoch", "indexed", "index_cursor")
    for name in scan(client, f"{prefix}lease:"):
        state, settling, updated_at = client.hmget(name, "state", "settling", "updated_at")
        if state in ("done", "dead") and settling != "1":
            client.zadd(f"{prefix}terminal", {name: float(updated_at or 0)})


def test_a_prefix_of_the_previous_version_is_indexed_once_and_read_right(
        redis_store_url: str, client: redis.Redis, clock: ManualClock,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefix without indexes: the first operator read builds them (in batches), and the
    reads answer as before; the terminal index goes; the epoch record says it is done."""
    prefix = prefix_of(redis_store_url)
    with open_store(redis_store_url, clock=clock) as writer:
        assert isinstance(writer, RedisStore)
        populate(writer, clock)
    make_legacy(client, prefix)
    assert client.exists(f"{prefix}terminal")
    client.set(f"{prefix}lease:broken", "not a hash")  # passed over, not an error
    monkeypatch.setattr(redis_store, "INDEX_BATCH", 3)  # many batches, even for a few keys
    with open_store(redis_store_url, clock=clock) as store:
        assert isinstance(store, RedisStore)
        assert store.stats().counts == {"done": 12, "running": 4, "dead": 3, "ready": 2}
        assert client.hget(f"{prefix}epoch", "indexed") == "1"
        assert not client.exists(f"{prefix}index:building")
        client.delete(f"{prefix}lease:broken")
        assert_indexed(client, prefix, store)


def test_the_build_loses_no_write_made_between_its_batches(
        redis_store_url: str, client: redis.Redis, clock: ManualClock,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Another worker claims, finishes, releases, kills, purges and requeues while the build
    walks the prefix: every row ends in the index of its state."""
    prefix = prefix_of(redis_store_url)
    worker = open_store(redis_store_url, clock=clock)
    assert isinstance(worker, RedisStore)
    populate(worker, clock)
    make_legacy(client, prefix)
    monkeypatch.setattr(redis_store, "INDEX_BATCH", 2)
    leases = [worker.claim(f"new:{i}", owner="w", ttl=30) for i in range(40)]
    writes: list[Callable[[], Any]] = []
    for i, lease in enumerate(leases):
        assert lease is not None
        writes += [lambda lease=lease, i=i: [worker.finish, worker.release,
                                             lambda lz: worker.kill(lz, reason="x")][i % 3](lease)]
    writes += [lambda: worker.purge("done:0"), lambda: worker.requeue("dead:0", reason="r"),
               lambda: worker.claim("ready:0", owner="w", ttl=30),
               lambda: worker.effect_insert("effect:c", "c" * 64, None)]
    page = RedisStore._scan_page

    def interleaved(self: RedisStore, cursor: int) -> Any:
        answer = page(self, cursor)
        for _ in range(3):
            if writes:
                clock.advance(0.5)
                writes.pop(0)()
        return answer

    monkeypatch.setattr(RedisStore, "_scan_page", interleaved)
    with open_store(redis_store_url, clock=clock) as store:
        assert isinstance(store, RedisStore)
        store.stats()
        monkeypatch.setattr(RedisStore, "_scan_page", page)
        while writes:
            writes.pop(0)()
        assert client.hget(f"{prefix}epoch", "indexed") == "1"
        assert_indexed(client, prefix, store)
    worker.close()


def test_retention_builds_the_indexes_a_slice_at_a_time(
        redis_store_url: str, client: redis.Redis, clock: ManualClock,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The sweeper's prune on an unindexed prefix builds a slice per call (its thread is not
    held for the whole prefix), resuming where the last one stopped, then prunes as before."""
    prefix = prefix_of(redis_store_url)
    with open_store(redis_store_url, clock=clock) as writer:
        populate(writer, clock)
    make_legacy(client, prefix)
    monkeypatch.setattr(redis_store, "INDEX_BATCH", 2)
    monkeypatch.setattr(redis_store, "BUILD_SLICE", 0.0)  # one batch a call
    clock.advance(1000)
    with open_store(redis_store_url, clock=clock) as store:
        assert isinstance(store, RedisStore)
        calls = 0
        while client.hget(f"{prefix}epoch", "indexed") != "1":
            store.purge_older_than(10_000, limit=100)
            calls += 1
            assert calls < 200
        assert calls > 1
        assert store.purge_older_than(500, limit=100) == 15  # 12 done + 3 dead
        assert_indexed(client, prefix, store)


def test_reads_scan_while_another_process_builds(
        redis_store_url: str, client: redis.Redis, clock: ManualClock) -> None:
    """The build lock held by someone else: the reads answer the old way, correctly."""
    prefix = prefix_of(redis_store_url)
    with open_store(redis_store_url, clock=clock) as writer:
        populate(writer, clock)
    make_legacy(client, prefix)
    client.set(f"{prefix}index:building", "someone-else", px=60_000)
    with open_store(redis_store_url, clock=clock) as store:
        assert store.stats().counts == {"done": 12, "running": 4, "dead": 3, "ready": 2}
        assert [r.key for r in store.find(state=LeaseState.DEAD, limit=2)] == [
            "dead:2", "dead:1"]
        assert client.hget(f"{prefix}epoch", "indexed") is None
    client.delete(f"{prefix}index:building")
    with open_store(redis_store_url, clock=clock) as store:
        assert isinstance(store, RedisStore)
        store.find(limit=1)  # builds them
        assert client.hget(f"{prefix}epoch", "indexed") == "1"
        assert_indexed(client, prefix, store)


def test_an_epoch_reset_keeps_the_indexes_mark(redis_store_url: str, client: redis.Redis,
                                               clock: ManualClock) -> None:
    """The indexes describe the data beside them: an operator's reset carries the mark over
    (and a record that is gone leaves a prefix that is indexed again)."""
    prefix = prefix_of(redis_store_url)
    with open_store(redis_store_url, clock=clock) as store:
        populate(store, clock)
        assert client.hget(f"{prefix}epoch", "indexed") == "1"
        store.reset_epoch()
        assert client.hget(f"{prefix}epoch", "indexed") == "1"
        assert_indexed(client, prefix, store)


def test_rows_stuck_settling_do_not_stall_retention(store: RedisStore, clock: ManualClock,
                                                   client: redis.Redis) -> None:
    """The done index holds settling rows too (find lists them): retention passes over them,
    oldest first, and still deletes the settled rows behind them."""
    for i in range(5):
        lease = store.claim(f"settling:{i}", owner="w", ttl=10)
        assert lease is not None and store.finish(lease, i, settle_within=3600)
        clock.advance(1)
    for i in range(3):
        lease = store.claim(f"settled:{i}", owner="w", ttl=10)
        assert lease is not None and store.finish(lease, i)
        clock.advance(1)
    clock.advance(100)
    assert store.purge_older_than(50, limit=2) == 2
    assert store.purge_older_than(50, limit=2) == 1
    assert store.purge_older_than(50, limit=2) == 0
    assert sorted(r.key for r in store.find(state=LeaseState.DONE)) == [
        f"settling:{i}" for i in range(5)]
    assert_indexed(client, prefix_of(store.url), store)


def test_a_filtered_find_reads_on_past_the_first_pages(store: RedisStore, clock: ManualClock,
                                                      sent: list[str]) -> None:
    """find(prefix=..., owner=...) keeps reading the index, newest first, until it has its
    rows: the oldest match is found behind many newer rows that do not match."""
    for i in range(3):
        assert store.claim(f"zz:{i}", owner="host:1:a", ttl=100)
        clock.advance(1)
    for i in range(60):
        assert store.claim(f"aa:{i}", owner="host:2:b", ttl=100)
        clock.advance(1)
    sent.clear()
    found = store.find(state=LeaseState.RUNNING, prefix="zz:", limit=2)
    assert [r.key for r in found] == ["zz:2", "zz:1"]
    assert "SCAN" not in sent
    assert [r.key for r in store.find(owner="host:1:a", limit=5)] == ["zz:2", "zz:1", "zz:0"]
    assert [r.key for r in store.find(prefix="aa:", limit=1)] == ["aa:59"]
