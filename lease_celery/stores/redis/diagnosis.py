"""What the Redis store says about its server (``RedisStore.diagnose``): eviction,
persistence and replication, read with ``CONFIG GET`` and ``INFO``, each of which can make
the server forget writes it acknowledged."""

from __future__ import annotations

from typing import Any

import redis

from ...models import Finding

__all__ = ["server_findings"]

#: What a Redis store loses when its server forgets acknowledged writes.
_LOSS = ("rows of running leases and effect receipts vanish. A loss of everything is "
         "caught by the store's epoch (nothing is granted until reset-epoch), but a loss "
         "of the latest writes is not: a second worker is granted a key a live owner "
         "holds, and an effect runs again")


def server_findings(client: redis.Redis, where: str) -> list[Finding]:
    """The findings about the server ``client`` talks to (``where``: how they name it)."""
    config: dict[Any, Any] = {}
    refused = ""
    try:
        for pattern in ("maxmemory*", "append*", "min-replicas-to-write"):
            config.update(client.config_get(pattern))
    except redis.RedisError as exc:  # CONFIG renamed away, or refused by an ACL
        refused = str(exc)
    try:
        replicas = int(client.info("replication").get("connected_slaves") or 0)
    except redis.RedisError:
        replicas = 0
    return [*_eviction(config, refused or "no maxmemory-policy in the reply", where),
            *_persistence(config, refused or "no appendonly in the reply", where),
            *_replicas(config, replicas, where)]


def _persistence(config: dict[Any, Any], refused: str, where: str) -> list[Finding]:
    """A restart keeps what the AOF fsynced: every write with ``appendfsync always``."""
    advice = "Set appendonly yes with appendfsync always"
    appendonly, fsync = config.get("appendonly"), config.get("appendfsync")
    if appendonly is None:
        return [Finding("store.redis_persistence", "warning", "ownership",
                        f"could not check the Redis lease store's ({where}) persistence "
                        f"(CONFIG GET: {refused}); a server that restarts without its "
                        f"acknowledged writes loses leases: {_LOSS}. {advice}")]
    if appendonly != "yes":
        return [Finding("store.redis_persistence", "warning", "ownership",
                        f"the Redis lease store ({where}) runs with appendonly no: a restart "
                        "loses every write since the last RDB snapshot (all of them without "
                        f"one): {_LOSS}. {advice}")]
    if fsync != "always":
        lost = ("up to a second of acknowledged writes" if fsync == "everysec"
                else "what the operating system had not yet written to disk")
        return [Finding("store.redis_persistence", "warning", "ownership",
                        f"the Redis lease store ({where}) runs with appendfsync {fsync}: a "
                        f"crash of its host loses {lost}: {_LOSS}. {advice}")]
    return []


def _replicas(config: dict[Any, Any], replicas: int, where: str) -> list[Finding]:
    """Replication is asynchronous: a failover to a replica that lags loses writes."""
    if not replicas or int(config.get("min-replicas-to-write") or 0) > 0:
        return []
    return [Finding(
        "store.redis_replicas", "warning", "ownership",
        f"the Redis lease store ({where}) has {replicas} replica(s) and "
        "min-replicas-to-write 0: a failover to a replica that had not received the latest "
        f"writes loses them: {_LOSS}. Set min-replicas-to-write (and "
        "min-replicas-max-lag), or use PostgreSQL for fencing that survives a failover")]


def _eviction(config: dict[Any, Any], refused: str, where: str) -> list[Finding]:
    """The store's ``maxmemory-policy``: an evicted lease row or token counter lets a key
    run again with its tokens restarted. ``noeviction`` is safe, and so is ``volatile-*``:
    lease keys never expire, so those policies never pick them."""
    policy = config.get("maxmemory-policy")
    advice = "Set maxmemory-policy noeviction (or volatile-*: lease keys never expire)"
    if not policy:
        return [Finding(
            "store.redis_eviction_unknown", "warning", "ownership",
            f"could not check the Redis lease store's ({where}) maxmemory-policy (CONFIG GET: "
            f"{refused}); an evicted lease row or token counter lets a key run again with its "
            f"tokens restarted. {advice}")]
    if policy == "noeviction" or policy.startswith("volatile-"):
        return []
    maxmemory = int(config.get("maxmemory") or 0)
    if not maxmemory:
        return [Finding(
            "store.redis_eviction", "warning", "ownership",
            f"the Redis lease store ({where}) has maxmemory-policy={policy!r}: nothing is "
            "evicted while maxmemory is 0 (no limit), but once a limit is set Redis evicts "
            f"lease rows and token counters, and keys run again with tokens restarted. {advice}")]
    return [Finding(
        "store.redis_eviction", "error", "ownership",
        f"the Redis lease store ({where}) has maxmemory-policy={policy!r} with "
        f"maxmemory={maxmemory}: once full, Redis evicts lease rows and token counters, and "
        f"keys run again with tokens restarted. {advice}")]
