"""Redis store, for deployments whose shared state already lives in Redis.

Each operation is one Lua script, run atomically by the server on the server's clock
(``TIME``). Keys live under a prefix (``?prefix=lease_celery:``); every lease key has a token
counter of its own beside its hash, so a purged and re-created key never restarts at 1.

Limit: Redis replicates asynchronously. A failover can lose the latest writes, and with them a
claim, so a token can go backwards and two owners can both believe they hold a key. PostgreSQL
is the store for strict fencing across failover.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from ..errors import ConfigError, StoreError
from ..models import EffectState, Lease, LeaseRecord, LeaseState, Receipt
from .base import (
    Clock,
    Store,
    check_key,
    check_owner,
    check_ttl,
    decode_result,
    encode_result,
    fence_params,
    lease_params,
)
from .queries import load_queries

try:
    import redis
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ConfigError("the Redis lease store needs redis-py: pip install 'lease-celery[redis]'"
                      ) from exc

__all__ = ["RedisStore"]

logger = logging.getLogger(__name__)

_SCRIPTS = load_queries("redis", ".lua")
_PRELUDE = _SCRIPTS["clock"]


class RedisStore(Store):
    """Lease store on Redis (``redis://host:port/db``, ``rediss://`` for TLS).

    URL options besides redis-py's own: ``prefix`` (default ``lease_celery:``).
    ``socket_connect_timeout`` and ``socket_timeout`` default to 5 seconds.
    """

    def __init__(self, url: str, *, clock: Clock | None = None) -> None:
        self.url = url
        self._clock = clock
        parts = urlsplit(url)
        query = dict(parse_qsl(parts.query, keep_blank_values=True))
        self.prefix = query.pop("prefix", "lease_celery:")
        query.setdefault("socket_connect_timeout", "5")
        query.setdefault("socket_timeout", "5")
        self._where = f"{parts.hostname or 'localhost'}:{parts.port or 6379}{parts.path or ''}"
        try:
            self._client = redis.Redis.from_url(
                urlunsplit((parts.scheme, parts.netloc, parts.path, urlencode(query), "")),
                decode_responses=True)
        except ValueError as exc:
            raise ConfigError(f"redis lease store URL {url!r}: {exc}") from exc
        # redis-py's connection pool notices fork() by pid and reconnects in the child.
        self._scripts = {name: self._client.register_script(f"{_PRELUDE}\n{body}")
                         for name, body in _SCRIPTS.items() if name != "clock"}
        self._lock = threading.Lock()

    def _keys(self, key: str) -> list[str]:
        return [f"{self.prefix}lease:{key}", f"{self.prefix}token:{key}"]

    def _injected_now(self) -> str:
        return "" if self._clock is None else repr(float(self._clock()))

    def _call(self, script: str, keys: list[str], args: list[Any]) -> Any:
        try:
            return self._scripts[script](keys=keys, args=[self._injected_now(), *args])
        except redis.RedisError as exc:
            raise StoreError(f"redis lease store at {self._where}: {exc}") from exc

    # -- contract ---------------------------------------------------------------------------

    def claim(self, key: str, *, owner: str, ttl: float) -> Lease | None:
        key, owner, ttl = check_key(key), check_owner(owner), check_ttl(ttl)
        reply = self._call("claim", [*self._keys(key), f"{self.prefix}fence"],
                           [owner, repr(ttl)])
        if not reply:
            return None
        token, deadline, fence = reply
        return Lease(key, owner, int(token), float(deadline), int(fence))

    def renew_many(self, leases: Sequence[Lease], *, ttl: float) -> dict[str, Lease | None]:
        ttl = check_ttl(ttl)
        if not leases:
            return {}
        args: list[Any] = [repr(ttl)]
        for lease in leases:
            params = fence_params(lease)
            args += [params["owner"], str(params["token"])]
        reply = self._call("renew", [self._keys(lease.key)[0] for lease in leases], args)
        return {lease.key: (Lease(lease.key, lease.owner, lease.token, float(deadline),
                                  lease.fence)
                            if deadline else None)
                for lease, deadline in zip(leases, reply, strict=True)}

    def renew(self, lease: Lease, *, ttl: float) -> Lease | None:
        return self.renew_many([lease], ttl=ttl)[lease.key]

    def finish(self, lease: Lease, result: Any = None) -> bool:
        encoded = encode_result(result)
        params = fence_params(lease)
        return bool(self._call("finish", self._keys(lease.key)[:1],
                               [params["owner"], str(params["token"]), "done", encoded]))

    def release(self, lease: Lease) -> bool:
        params = fence_params(lease)
        return bool(self._call("finish", self._keys(lease.key)[:1],
                               [params["owner"], str(params["token"]), "ready", ""]))

    def purge(self, key: str) -> bool:
        return bool(self._call("purge", self._keys(check_key(key)), []))

    def get(self, key: str) -> LeaseRecord | None:
        key = check_key(key)
        try:
            fields = self._client.hgetall(self._keys(key)[0])
        except redis.RedisError as exc:
            raise StoreError(f"redis lease store at {self._where}: {exc}") from exc
        if not fields:
            return None
        row = {str(k): str(v) for k, v in fields.items()}  # decode_responses: already str
        return LeaseRecord(key=key, state=LeaseState(row["state"]), owner=row.get("owner"),
                           token=int(row["token"]), expires_at=float(row["expires_at"]),
                           attempts=int(row.get("attempts", 0)),
                           result=decode_result(row.get("result")),
                           updated_at=float(row["updated_at"]), fence=int(row.get("fence", 0)))

    # -- effect receipts --------------------------------------------------------------------

    def _effect_key(self, key: str) -> list[str]:
        return [f"{self.prefix}effect:{check_key(key)}"]

    def effect_insert(self, key: str, fingerprint: str, lease: Lease | None) -> bool:
        who = lease_params(lease)
        return bool(self._call("effect_insert", self._effect_key(key), [
            fingerprint, who["lease_key"] or "", "" if lease is None else str(lease.token),
            who["lease_owner"] or ""]))

    def effect_get(self, key: str) -> Receipt | None:
        try:
            row = self._client.hgetall(self._effect_key(key)[0])
        except redis.RedisError as exc:
            raise StoreError(f"redis lease store at {self._where}: {exc}") from exc
        if not row:
            return None
        f = {str(k): str(v) for k, v in row.items()}
        return Receipt(key=key, fingerprint=f["fingerprint"], state=EffectState(f["state"]),
                       lease_key=f["lease_key"] or None,
                       lease_token=int(f["lease_token"]) if f["lease_token"] else None,
                       lease_owner=f["lease_owner"] or None,
                       started_at=float(f["started_at"]), attempts=int(f["attempts"]),
                       result=decode_result(f.get("result")), version=int(f["version"]),
                       updated_at=float(f["updated_at"]))

    def effect_update(self, key: str, *, version: int, state: EffectState,
                      result: str | None) -> bool:
        return bool(self._call("effect_update", self._effect_key(key),
                               [str(version), state.value, result or ""]))

    def effect_restart(self, key: str, *, version: int, lease: Lease | None) -> bool:
        who = lease_params(lease)
        return bool(self._call("effect_restart", self._effect_key(key), [
            str(version), who["lease_key"] or "", "" if lease is None else str(lease.token),
            who["lease_owner"] or ""]))

    def effect_delete(self, key: str, *, version: int) -> bool:
        return bool(self._call("effect_delete", self._effect_key(key), [str(version)]))

    def now(self) -> float:
        return float(self._call("now", [], []))

    def close(self) -> None:
        self._client.close()
