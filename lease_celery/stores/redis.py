"""Redis store, for deployments whose shared state already lives in Redis.

Each operation is one Lua script, run atomically by the server on the server's clock
(``TIME``). Keys live under a prefix (``?prefix=lease_celery:``); every lease key has a token
counter of its own beside its hash, so a purged and re-created key never restarts at 1.

Limit: Redis replicates asynchronously. A failover can lose the latest writes, and with them a
claim, so a token can go backwards and two owners can both believe they hold a key. PostgreSQL
is the store for strict fencing across failover.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from ..checks import (
    cancel_reason,
    check_delay,
    check_key,
    check_limit,
    check_owner,
    check_ttl,
    decode_result,
    decode_task,
    encode_result,
    encode_task,
)
from ..errors import ConfigError, StoreError
from ..extras import needs
from ..identity import owned_by
from ..models import (
    EffectState,
    HistoryEntry,
    Lease,
    LeaseRecord,
    LeaseState,
    Receipt,
    StoreStats,
)
from .base import (
    DEFAULT_SWEEP_GRACE,
    Clock,
    Store,
    fence_params,
    lease_not_current,
    lease_params,
    settle_deadline_offset,
)
from .queries import load_queries
from .urls import server_address

with needs("the Redis lease store", "redis-py", extra="redis"):
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    from .redis_options import connection_options
    from .redis_wire import ScriptCaller

#: Events kept per key, and across keys (``recent_history``), on Redis.
HISTORY_PER_KEY = 100
HISTORY_RECENT = 1000

__all__ = ["RedisStore"]

logger = logging.getLogger(__name__)

_SCRIPTS = load_queries("redis", ".lua")
_PRELUDE = (_SCRIPTS["clock"].replace("__HISTORY_PER_KEY__", str(HISTORY_PER_KEY))
            .replace("__HISTORY_RECENT__", str(HISTORY_RECENT)))


class RedisStore(Store):
    """Lease store on Redis (``redis://host:port/db``, ``rediss://`` for TLS).

    URL options: ``prefix`` (default ``lease_celery:``), and the redis-py connection options
    the store hands on: ``socket_timeout`` and ``socket_connect_timeout`` (seconds, default
    5), ``socket_keepalive``, ``health_check_interval``, ``client_name``, ``db``, and on
    ``rediss://`` the ``ssl_*`` ones (``ssl_cert_reqs``, ``ssl_ca_certs``, ...). Any other
    option, or one given twice, is a ``ConfigError`` naming it, raised without connecting:
    the store sets the others itself (``decode_responses``, its retry) or cannot honour them.
    """

    def __init__(self, url: str, *, clock: Clock | None = None) -> None:
        self.url = url
        self._clock = clock
        parts = urlsplit(url)
        self._where = server_address("redis", parts, 6379)
        self.prefix, connection = connection_options(parts, f"{parts.scheme}://{self._where}")
        try:
            # redis-py would silently re-send after a dropped connection; _call does it instead,
            # knowing that a re-sent write may be judged against the first one's effect.
            self._client = redis.Redis.from_url(
                urlunsplit((parts.scheme, parts.netloc, "", "", "")),
                decode_responses=True, retry=Retry(NoBackoff(), 0), **connection)
        except ValueError as exc:
            raise ConfigError(f"redis lease store URL for {self._where}: {exc}") from exc
        # After fork() the child makes connections of its own: redis-py's pool notices by pid
        # (the operator commands' calls), and so does the script caller (redis_wire).
        self._scripts = {name: self._client.register_script(f"{_PRELUDE}\n{body}")
                         for name, body in _SCRIPTS.items() if name != "clock"}
        self._caller = ScriptCaller(self._client.connection_pool)
        self._lock = threading.Lock()

    @property
    def _running(self) -> str:
        """The sorted set of running lease hashes by deadline (what the sweeper reads)."""
        return f"{self.prefix}running"

    def _keys(self, key: str) -> list[str]:
        return [f"{self.prefix}lease:{key}", f"{self.prefix}token:{key}"]

    @contextmanager
    def _errors(self) -> Iterator[None]:
        """redis-py's errors as ``StoreError`` naming the server: every call the store makes
        on its client runs in here (scripts run through ``_call``, which does the same)."""
        try:
            yield
        except redis.RedisError as exc:
            raise StoreError(f"redis lease store at {self._where}: {exc}") from exc

    def _injected_now(self) -> str:
        return "" if self._clock is None else repr(float(self._clock()))

    def _call(self, script: str, keys: list[str], args: list[Any], *,
              if_resent: Callable[[Any], Any] | None = None) -> Any:
        """Run one script; after a dropped connection, send it once more (see ``if_resent``).

        A script whose reply was lost may have run; ``if_resent`` corrects the re-sent copy's
        answer, which is judged against the first one's effect.
        """
        for attempt in (1, 2):
            try:
                reply = self._caller.run(self._scripts[script], keys,
                                         [self._injected_now(), *args])
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                if attempt == 2:
                    raise StoreError(f"redis lease store at {self._where}: {exc}") from exc
                logger.warning("redis lease store at %s: %s; sending again", self._where, exc)
                continue
            except redis.RedisError as exc:
                raise StoreError(f"redis lease store at {self._where}: {exc}") from exc
            return if_resent(reply) if attempt == 2 and if_resent is not None else reply
        raise AssertionError("unreachable")  # pragma: no cover

    # -- contract ---------------------------------------------------------------------------

    def claim(self, key: str, *, owner: str, ttl: float,
              task: Mapping[str, Any] | None = None) -> Lease | None:
        key, owner, ttl = check_key(key), check_owner(owner), check_ttl(ttl)
        nonce = uuid.uuid4().hex
        reply = self._call("claim", [*self._keys(key), f"{self.prefix}fence", self._running],
                           [owner, repr(ttl), encode_task(task) or "", nonce],
                           # Refused after a re-send: did the first send win? Its nonce would
                           # be on the row.
                           if_resent=lambda reply: reply or self._claimed_by(key, owner, nonce))
        if not reply:
            return None
        token, deadline, fence, attempts, takeovers, *cancel = reply
        return Lease(key, owner, int(token), float(deadline), int(fence),
                     attempts=int(attempts), takeovers=int(takeovers),
                     cancel=(cancel[0] if cancel else None) or None)

    def _claimed_by(self, key: str, owner: str, nonce: str,
                    state: str | None = "running") -> list[str] | None:
        """Does the row carry this claim call's nonce (``state``: and that state)?"""
        with self._errors():
            fields = self._client.hmget(self._keys(key)[0], [
                "state", "owner", "nonce", "token", "expires_at", "fence", "attempts",
                "takeovers", "cancel"])
        row_state, row_owner, row_nonce, *rest = (
            str(v) if v is not None else None for v in fields)
        if (row_owner, row_nonce) != (owner, nonce) or (state is not None and row_state != state):
            return None
        *numbers, cancel = rest
        return [*(v or "0" for v in numbers), cancel or ""]

    def renew_many(self, leases: Sequence[Lease], *, ttl: float) -> list[Lease | None]:
        ttl = check_ttl(ttl)
        if not leases:
            return []
        args: list[Any] = [repr(ttl)]
        for lease in leases:
            params = fence_params(lease)
            args += [params["owner"], str(params["token"])]
        reply = self._call("renew", [self._running,
                                     *(self._keys(lease.key)[0] for lease in leases)], args)
        return [dataclasses.replace(lease, expires_at=float(deadline), cancel=cancel or None)
                if deadline else None
                for lease, (deadline, cancel) in zip(leases, reply, strict=True)]

    def renew(self, lease: Lease, *, ttl: float) -> Lease | None:
        return self.renew_many([lease], ttl=ttl)[0]

    def _fenced_write(self, lease: Lease, state: LeaseState, *, result: str = "",
                      reason: str | None = None, delay: float = 0.0,
                      settle_within: float | None = None) -> bool:
        params = fence_params(lease)
        within = settle_deadline_offset(settle_within)
        return bool(self._call("fenced_write", [self._keys(lease.key)[0], self._running], [
            params["owner"], str(params["token"]), state.value, result, reason or "",
            repr(delay), "" if within is None else repr(within)],
            if_resent=lambda ok: ok or self.settled_by(lease, state)))

    def finish(self, lease: Lease, result: Any = None, *,
               settle_within: float | None = None) -> bool:
        return self._fenced_write(lease, LeaseState.DONE, result=encode_result(result),
                                  settle_within=settle_within)

    def release(self, lease: Lease, *, delay: float = 0.0, reason: str | None = None) -> bool:
        return self._fenced_write(lease, LeaseState.READY, reason=reason,
                                  delay=check_delay(delay))

    def kill(self, lease: Lease, *, reason: str, settle_within: float | None = None) -> bool:
        return self._fenced_write(lease, LeaseState.DEAD, reason=reason,
                                  settle_within=settle_within)

    def checkpoint(self, lease: Lease, data: str) -> bool:
        params = fence_params(lease)
        # Re-sent after a lost reply, the same write is judged again: still ours, accepted.
        return bool(self._call("checkpoint", [self._keys(lease.key)[0]], [
            params["owner"], str(params["token"]), str(data)]))

    def cancel(self, key: str, *, reason: str) -> bool:
        lease_hash, counter = self._keys(check_key(key))
        return bool(self._call("cancel", [lease_hash, self._running, counter],
                               [cancel_reason(reason)]))

    def settle_many(self, leases: Sequence[Lease]) -> list[bool]:
        if not leases:
            return []
        args: list[Any] = []
        for lease in leases:
            params = fence_params(lease)
            args += [params["owner"], str(params["token"])]
        # Idempotent: a row this owner already settled answers 1, so a re-send is harmless.
        reply = self._call("settle_many", [self._running,
                                           *(self._keys(lease.key)[0] for lease in leases)], args)
        return [bool(int(ok)) for ok in reply]

    def claim_settlement(self, key: str, *, owner: str, ttl: float) -> Lease | None:
        key, owner, ttl = check_key(key), check_owner(owner), check_ttl(ttl)
        nonce = uuid.uuid4().hex
        reply = self._call("claim_settlement", [self._keys(key)[0], self._running],
                           [owner, repr(ttl), nonce],
                           if_resent=lambda reply: reply or self._claimed_by(
                               key, owner, nonce, state=None))
        if not reply:
            return None
        token, deadline, fence, attempts, takeovers, *_ = reply
        return Lease(key, owner, int(token), float(deadline), int(fence),
                     attempts=int(attempts), takeovers=int(takeovers))

    # -- operator actions (SCAN-based listing: fine for operations, not for a hot path) -----

    def force_release(self, key: str, *, reason: str) -> bool:
        return bool(self._call("force_release", [self._keys(check_key(key))[0], self._running],
                               [reason]))

    def requeue(self, key: str, *, reason: str) -> LeaseRecord | None:
        requeued = self._call("requeue", [self._keys(check_key(key))[0], self._running], [reason])
        return self.get(key) if requeued else None

    def _lease_keys(self) -> Iterator[str]:
        """Every lease key in the store (its hash names, prefix stripped)."""
        head = f"{self.prefix}lease:"
        pattern = "".join(f"[{c}]" if c in "*?[]\\" else c for c in head) + "*"
        with self._errors():
            for name in self._client.scan_iter(match=pattern, count=500):
                yield str(name)[len(head):]

    def find(self, *, state: LeaseState | None = None, prefix: str | None = None,
             owner: str | None = None, limit: int = 100) -> list[LeaseRecord]:
        limit = check_limit(limit)
        wanted = None if state is None else LeaseState(state)
        records = [record for key in self._lease_keys()
                   if (prefix is None or key.startswith(prefix))
                   and (record := self.get(key)) is not None
                   and (wanted is None or record.state is wanted)
                   and (owner is None or owned_by(record.owner, owner))]
        records.sort(key=lambda r: r.updated_at or 0.0, reverse=True)
        return records[:limit]

    def stats(self) -> StoreStats:
        now = self.now()
        counts: dict[str, int] = {}
        expired = 0
        for key in self._lease_keys():
            record = self.get(key)
            if record is None:
                continue
            counts[record.state.value] = counts.get(record.state.value, 0) + 1
            expired += (record.state is LeaseState.RUNNING
                        and (record.expires_at or 0.0) <= now)
        return StoreStats(counts=counts, expired=expired)

    def purge_older_than(self, seconds: float, *, limit: int | None = None) -> int:
        seconds = check_delay(seconds)
        if limit is not None:  # retention: the oldest, from the terminal index
            return int(self._call("prune", [self._running],
                                  [repr(seconds), str(check_limit(limit))]))
        # All of them (an operator's purge): every hash, rows written before the terminal
        # index existed included.
        return sum(int(self._call("purge_old", [self._keys(key)[0], self._running],
                                  [repr(seconds)]))
                   for key in list(self._lease_keys()))

    def sweep_unmark(self, key: str, token: int) -> bool:
        return bool(self._call("sweep_unmark", [self._keys(check_key(key))[0], self._running],
                               [str(token)]))

    def sweep_expired(self, *, limit: int = 100,
                      grace: float = DEFAULT_SWEEP_GRACE) -> list[LeaseRecord]:
        # One script over the attention index: the cost follows what is due, not the store
        # size. A re-sent sweep finds its first send's marks set: those rows come back one
        # grace period later.
        hashes = self._call("sweep", [self._running], [
            str(check_limit(limit)), repr(check_delay(grace, name="grace")), uuid.uuid4().hex])
        head = f"{self.prefix}lease:"
        return [record for name in hashes
                if (record := self.get(str(name)[len(head):])) is not None]

    # -- history: a capped list per key (it goes with the key's hash) and one across keys ---

    def record_history_many(self, entries: Sequence[HistoryEntry]) -> None:
        if not entries:
            return
        # One script call per batch: packing a command costs the writer thread (and so the
        # tasks sharing its GIL) far more than packing one more argument.
        args: list[Any] = [str(HISTORY_PER_KEY), str(HISTORY_RECENT)]
        for entry in entries:
            args += [entry.key, json.dumps(_entry_fields(entry), separators=(",", ":"))]
        self._call("history_append", [f"{self.prefix}history"], args)

    def _history_list(self, name: str, start: int, end: int) -> list[HistoryEntry]:
        with self._errors():
            items = self._client.lrange(name, start, end)
        return [HistoryEntry(**json.loads(item)) for item in items]

    def history(self, key: str, *, limit: int = 100) -> list[HistoryEntry]:
        return self._history_list(f"{self.prefix}history:{check_key(key)}",
                                  -check_limit(limit), -1)

    def recent_history(self, *, events: Sequence[str] | None = None,
                       limit: int = 100) -> list[HistoryEntry]:
        limit = check_limit(limit)
        entries = self._history_list(f"{self.prefix}history", 0, HISTORY_RECENT - 1)
        wanted = None if events is None else set(events)
        return [e for e in entries if wanted is None or e.event in wanted][:limit]

    def prune_history(self, seconds: float, *, limit: int = 1000) -> int:
        # Nothing to prune by age: each key's list is capped and deleted with its hash (by
        # retention or purge), and the list across keys keeps the latest HISTORY_RECENT.
        check_delay(seconds)
        return 0

    def purge(self, key: str) -> bool:
        return bool(self._call("purge", [*self._keys(check_key(key)), self._running], []))

    def get(self, key: str) -> LeaseRecord | None:
        key = check_key(key)
        with self._errors():
            fields = self._client.hgetall(self._keys(key)[0])
        if not fields:
            return None
        row = {str(k): str(v) for k, v in fields.items()}  # decode_responses: already str
        return LeaseRecord(key=key, state=LeaseState(row["state"]), owner=row.get("owner"),
                           token=int(row["token"]), expires_at=float(row["expires_at"]),
                           attempts=int(row.get("attempts", 0)),
                           result=decode_result(row.get("result")),
                           updated_at=float(row["updated_at"]), fence=int(row.get("fence", 0)),
                           takeovers=int(row.get("takeovers", 0)),
                           not_before=float(row["not_before"]) if "not_before" in row else None,
                           reason=row.get("reason"), task=_task(row),
                           settling=row.get("settling") == "1",
                           checkpoint=decode_result(row.get("checkpoint")),
                           cancel=row.get("cancel"))

    # -- effect receipts --------------------------------------------------------------------

    def _effect_key(self, key: str) -> list[str]:
        return [f"{self.prefix}effect:{check_key(key)}"]

    def effect_insert(self, key: str, fingerprint: str, lease: Lease | None) -> bool:
        return self._effect_write("effect_insert", key, lease, [fingerprint])

    def _effect_write(self, script: str, key: str, lease: Lease | None,
                      leading: list[str]) -> bool:
        """Run a receipt script fenced on ``lease`` (-1 back means it was not current)."""
        who = lease_params(lease)
        lease_hash = self._keys(lease.key)[0] if lease is not None else f"{self.prefix}none"
        reply = self._call(script, [*self._effect_key(key), lease_hash], [
            *leading, who["lease_key"] or "", "" if lease is None else str(lease.token),
            who["lease_owner"] or ""])
        if lease is not None and int(reply) == -1:
            raise lease_not_current(lease, "when the effect was to start")
        return bool(int(reply) == 1)

    def effect_get(self, key: str) -> Receipt | None:
        with self._errors():
            row = self._client.hgetall(self._effect_key(key)[0])
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

    def effect_find(self, *, state: EffectState | None = None,
                    limit: int = 100) -> list[Receipt]:
        # SCAN-based, like find(): an operator's listing, not a hot path.
        limit = check_limit(limit)
        wanted = None if state is None else EffectState(state)
        head = f"{self.prefix}effect:"
        pattern = "".join(f"[{c}]" if c in "*?[]\\" else c for c in head) + "*"
        with self._errors():
            names = [str(name) for name in self._client.scan_iter(match=pattern, count=500)]
        receipts = [receipt for name in names
                    if (receipt := self.effect_get(name[len(head):])) is not None
                    and (wanted is None or receipt.state is wanted)]
        receipts.sort(key=lambda r: r.updated_at, reverse=True)
        return receipts[:limit]

    def effect_update(self, key: str, *, version: int, state: EffectState,
                      result: str | None) -> bool:
        return bool(self._call("effect_update", self._effect_key(key),
                               [str(version), state.value, result or ""]))

    def effect_restart(self, key: str, *, version: int, lease: Lease | None) -> bool:
        return self._effect_write("effect_restart", key, lease, [str(version)])

    def effect_delete(self, key: str, *, version: int) -> bool:
        return bool(self._call("effect_delete", self._effect_key(key), [str(version)]))

    def now(self) -> float:
        return float(self._call("now", [], []))

    def close(self) -> None:
        self._caller.close()
        self._client.close()


def _entry_fields(entry: HistoryEntry) -> dict[str, Any]:
    return {"key": entry.key, "at": entry.at, "event": entry.event, "owner": entry.owner,
            "token": entry.token, "fence": entry.fence, "detail": entry.detail}


def _task(row: dict[str, str]) -> dict[str, Any] | None:
    """The row's task info; a settled done row keeps only its task id (``drop_task`` in
    redis.lua), shown in the shape the SQL stores keep it in."""
    if "task" in row:
        return decode_task(row["task"])
    if "task_id" in row:
        return {"options": {"task_id": row["task_id"]}}
    return None

