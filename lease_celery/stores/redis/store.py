"""Redis store, for deployments whose shared state already lives in Redis.

Each operation is one Lua script, run atomically by the server on the server's clock
(``TIME``). Keys live under a prefix (``?prefix=lease_celery:``); every lease key has a token
counter of its own beside its hash, so a purged and re-created key never restarts at 1.

The store's epoch: the first open writes an epoch record (``<prefix>epoch``: a random id, the
creation time, and a floor that every token and fence number of the epoch is above). Every
script checks that the record is still the one this store object opened: a Redis restarted
without persistence, or a failover to a replica without the record, is caught at the next
call by any process that used the store before, which marks the record lost; from then on
every process's writes are refused with ``StoreDataLost`` until an operator runs ``celery -A
APP leases reset-epoch --accept-data-loss``. An empty store opens without a step. Counters
start above the epoch's creation time in microseconds, so even a store that lost everything
with every process restarted never hands out a token or fence number again.

Operator reads (``find``, ``stats``, ``effects.find``, retention) read state indexes that every
script keeps atomically with its transition (``prelude.lua``: a sorted set of hashes per state
by ``updated_at``), never a SCAN of the prefix: their cost follows what they return, not the
store's size. A prefix the version before wrote has none: the first operator read (or the
sweeper's prune, a slice at a time) builds them once, in batches, while workers go on writing
(``index_build.lua`` says why nothing is lost); until the epoch record says they are complete,
the reads SCAN as before.

Limit: a loss that leaves the epoch record (``appendfsync everysec`` losing its last second, a
replica that lagged by a few writes) is not seen. Redis replicates asynchronously; PostgreSQL
is the store for strict fencing across failover (``doctor`` checks the persistence settings).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Concatenate, ParamSpec, TypeVar
from urllib.parse import urlsplit, urlunsplit

from ...errors import ConfigError, StoreDataLost, StoreError
from ...extras import needs
from ...identity import owned_by
from ...limits import Rate
from ...models import (
    EffectState,
    EpochReset,
    Finding,
    HistoryEntry,
    Lease,
    LeaseState,
    StoreEpoch,
)
from ..base import PURGE_BATCH, Clock, Row, Store, lease_params
from ..rows import task_id_only
from ..urls import server_address
from .lua import HISTORY_PER_KEY, HISTORY_RECENT, PRELUDE, SCRIPTS

with needs("the Redis lease store", "redis-py", extra="redis"):
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    from .diagnosis import server_findings
    from .options import connection_options
    from .wire import ScriptCaller

__all__ = ["RedisStore"]

_P = ParamSpec("_P")
_T = TypeVar("_T")


def _server_errors(method: Callable[Concatenate[RedisStore, _P], _T]
                   ) -> Callable[Concatenate[RedisStore, _P], _T]:
    """redis-py's errors out of ``method`` as ``StoreError`` naming the server."""
    @functools.wraps(method)
    def wrapped(store: RedisStore, /, *args: _P.args, **kwargs: _P.kwargs) -> _T:
        try:
            return method(store, *args, **kwargs)
        except redis.RedisError as exc:
            raise store._failed(exc) from exc

    return wrapped


#: The scripts whose writes ``?wait_replicas=N`` waits for: those a failover must not lose
#: (a claim's token, an accepted outcome, a receipt), and the epoch itself.
_REPLICATED = frozenset({"claim", "claim_limited", "claim_settlement", "fenced_write",
                         "finish_and_claim",
                         "settle_many", "record_published",
                         "effect_insert", "effect_restart", "effect_update", "epoch_open",
                         "epoch_reset"})

#: The fields of a claimed row, in the order the claim script answers with them.
_CLAIMED = ("token", "expires_at", "fence", "attempts", "takeovers", "cancel")

#: The states, in the order stats.lua answers their counts.
_LEASE_STATES = tuple(state.value for state in LeaseState)
_EFFECT_STATES = tuple(state.value for state in EffectState)
#: The build of the indexes of a prefix the version before wrote: keys a SCAN page examines
#: (one index_build script a page, so Redis is held for about a millisecond at a time: a
#: million rows take some 20 s, and meanwhile a worker's claim + finish waits 1.5 ms at the
#: median, 8 ms at worst, where pages of 1000 made it 5 and 28 ms); how long the build's lock
#: lasts unless renewed (a builder that died is taken over after it); and the seconds of
#: building one retention prune does (the sweeper's thread, once per interval, is not held
#: for a whole prefix).
INDEX_BATCH = 250
#: The most index members a listing reads from one index in a round trip.
_PAGE_MAX = 1000
BUILD_LOCK_MS = 30_000
BUILD_SLICE = 0.5

logger = logging.getLogger(__name__)



class RedisStore(Store):
    """Lease store on Redis (``redis://host:port/db``, ``rediss://`` for TLS).

    URL options: ``prefix`` (default ``lease_celery:``); ``wait_replicas=N`` (and
    ``wait_timeout``, seconds, default 1): after each claim, outcome and receipt write, wait
    for N replicas to acknowledge it (Redis ``WAIT``), else ``StoreError``; and the redis-py
    connection options
    the store hands on: ``socket_timeout`` and ``socket_connect_timeout`` (seconds, default
    5), ``socket_keepalive``, ``health_check_interval``, ``client_name``, ``db``, and on
    ``rediss://`` the ``ssl_*`` ones (``ssl_cert_reqs``, ``ssl_ca_certs``, ...). Any other
    option, or one given twice, is a ``ConfigError`` naming it, raised without connecting:
    the store sets the others itself (``decode_responses``, its retry) or cannot honour them.
    """

    carries_finish = True  # finish_and_claim: one script, one round trip

    def __init__(self, url: str, *, clock: Clock | None = None) -> None:
        self.url = url
        self._clock = clock
        parts = urlsplit(url)
        self._where = server_address("redis", parts, 6379)
        self.prefix, self._wait, connection = connection_options(
            parts, f"{parts.scheme}://{self._where}")
        try:
            # redis-py would silently re-send after a dropped connection; _call does it instead,
            # knowing that a re-sent write may be judged against the first one's effect.
            self._client = redis.Redis.from_url(
                urlunsplit((parts.scheme, parts.netloc, "", "", "")),
                decode_responses=True, retry=Retry(NoBackoff(), 0), **connection)
        except ValueError as exc:
            raise ConfigError(f"redis lease store URL for {self._where}: {exc}") from exc
        # After fork() the child makes connections of its own: redis-py's pool notices by pid
        # (the operator commands' calls), and so does the script caller (wire).
        self._scripts = {name: self._client.register_script(f"{PRELUDE}\n{body}")
                         for name, body in SCRIPTS.items()}
        self._caller = ScriptCaller(self._client.connection_pool)
        self._lock = threading.Lock()
        # The epoch this store object opened (None: not yet: the first call opens it).
        self._epoch: StoreEpoch | None = None
        # Are the state indexes complete (the epoch record's mark, seen once: it never goes)?
        self._indexed = False
        self._builder = uuid.uuid4().hex

    @property
    def _running(self) -> str:
        """The sorted set of running lease hashes by deadline (what the sweeper reads)."""
        return f"{self.prefix}running"

    def _keys(self, key: str) -> list[str]:
        return [f"{self.prefix}lease:{key}", f"{self.prefix}token:{key}"]

    def _failed(self, exc: Exception) -> StoreError:
        return StoreError(f"redis lease store at {self._where}: {exc}")

    # Every command the store sends runs in one of these five (scripts through _call):
    # each turns redis-py's errors into a StoreError naming the server.

    @_server_errors
    def _hgetall(self, name: str) -> dict[str, str]:
        return {str(k): str(v) for k, v in self._client.hgetall(name).items()}

    @_server_errors
    def _hmget(self, name: str, fields: Sequence[str]) -> list[str | None]:
        return [None if v is None else str(v) for v in self._client.hmget(name, list(fields))]

    @_server_errors
    def _smembers(self, name: str) -> list[str]:
        return [str(member) for member in self._client.smembers(name)]

    @_server_errors
    def _exists(self, name: str) -> bool:
        return bool(self._client.exists(name))

    @_server_errors
    def _lrange(self, name: str, start: int, end: int) -> list[str]:
        return [str(item) for item in self._client.lrange(name, start, end)]

    @_server_errors
    def _lrange_many(self, names: Sequence[str], start: int, end: int) -> list[list[str]]:
        """LRANGE of each list, in one round trip (a pipeline without MULTI)."""
        pipe = self._client.pipeline(transaction=False)
        for name in names:
            pipe.lrange(name, start, end)
        return [[str(item) for item in items] for items in pipe.execute()]

    @_server_errors
    def _hgetall_many(self, names: Sequence[str]) -> list[dict[str, str]]:
        """HGETALL of each hash, in one round trip (a pipeline without MULTI)."""
        pipe = self._client.pipeline(transaction=False)
        for name in names:
            pipe.hgetall(name)
        return [{str(k): str(v) for k, v in fields.items()} for fields in pipe.execute()]

    @_server_errors
    def _zrevrange_many(self, names: Sequence[str], starts: Sequence[int],
                        count: int) -> list[list[tuple[str, float]]]:
        """``count`` members of each sorted set from its ``start``, highest score first, with
        their scores, in one round trip."""
        pipe = self._client.pipeline(transaction=False)
        for name, start in zip(names, starts, strict=True):
            pipe.zrevrange(name, start, start + count - 1, withscores=True)
        return [[(str(member), float(score)) for member, score in members]
                for members in pipe.execute()]

    @_server_errors
    def _scan_page(self, cursor: int) -> tuple[int, list[str]]:
        """One SCAN page of the prefix's names (the build of the indexes)."""
        following, names = self._client.scan(cursor, match=_pattern(self.prefix),
                                             count=INDEX_BATCH)
        return int(following), [str(name) for name in names]

    @_server_errors
    def _scan(self, head: str) -> list[str]:
        """The names that start with ``head``, ``head`` stripped (SCAN: an operator's
        listing, not a hot path)."""
        return [str(name)[len(head):]
                for name in self._client.scan_iter(match=_pattern(head), count=500)]

    def _injected_now(self) -> str:
        return "" if self._clock is None else repr(float(self._clock()))

    def _call(self, script: str, keys: list[str], args: list[Any], *,
              if_resent: Callable[[Any], Any] | None = None) -> Any:
        """Run one script in this store's epoch (opening it first); after a dropped
        connection, send it once more (see ``if_resent``).

        A script whose reply was lost may have run; ``if_resent`` corrects the re-sent copy's
        answer, which is judged against the first one's effect. A script refused because an
        operator reset the epoch wrote nothing: it is sent again in the new epoch.
        """
        for _ in (1, 2):
            try:
                return self._send(script, keys, args, self._opened().id, if_resent)
            except _EpochChanged:
                self._epoch = None
        raise StoreError(f"redis lease store at {self._where}: its epoch changed twice during "
                         "one call")

    def _send(self, script: str, keys: list[str], args: list[Any], epoch: str,
              if_resent: Callable[[Any], Any] | None) -> Any:
        header = [f"{self.prefix}epoch", epoch, self._injected_now()]
        wait = self._wait if script in _REPLICATED else None
        for attempt in (1, 2):
            try:
                reply, acknowledged = self._caller.run(
                    self._scripts[script], keys, [*header, *args],
                    wait=None if wait is None else (wait.replicas, wait.timeout_ms))
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                if attempt == 2:
                    raise self._failed(exc) from exc
                logger.warning("redis lease store at %s: %s; sending again", self._where, exc)
                continue
            except redis.ResponseError as exc:
                raise self._refused(exc) from exc
            except redis.RedisError as exc:
                raise self._failed(exc) from exc
            if wait is not None and acknowledged is not None and acknowledged < wait.replicas:
                raise StoreError(
                    f"redis lease store at {self._where}: {script} reached the primary, but "
                    f"{acknowledged} of the {wait.replicas} replicas wait_replicas asks for "
                    f"acknowledged it within {wait.timeout:g}s: a failover now could lose it")
            return if_resent(reply) if attempt == 2 and if_resent is not None else reply
        raise AssertionError("unreachable")  # pragma: no cover

    def _refused(self, exc: redis.ResponseError) -> Exception:
        """A script's error reply: the epoch's (lost, or reset by an operator), or the server's."""
        text = str(exc)
        if text.startswith("LEASE_EPOCH_CHANGED"):
            return _EpochChanged(text)
        if text.startswith("LEASE_EPOCH_LOST"):
            return StoreDataLost(
                f"redis lease store at {self._where} (prefix {self.prefix!r}) lost its data: "
                f"{text.removeprefix('LEASE_EPOCH_LOST').strip()}. A restart without "
                "persistence, or a failover to a replica that lagged, drops acknowledged "
                "writes: running leases, tokens and receipts. Nothing is granted until an "
                "operator runs `celery -A APP leases reset-epoch --accept-data-loss`")
        return self._failed(exc)

    # -- the epoch (the prelude of every script checks it) ----------------------------------

    def _opened(self) -> StoreEpoch:
        """The epoch this store object works in, opening it on first use."""
        epoch = self._epoch
        if epoch is None:
            with self._lock:
                if self._epoch is None:
                    reply = self._send("epoch_open", [
                        f"{self.prefix}epoch", f"{self.prefix}fence", self._running,
                        f"{self.prefix}terminal", f"{self.prefix}history"],
                        [uuid.uuid4().hex], "", None)
                    self._epoch = _epoch_of(reply)
                    self._indexed = self._indexed or (len(reply) > 3 and reply[3] == "1")
                epoch = self._epoch
        return epoch

    def epoch(self) -> StoreEpoch:
        """The epoch this store object works in, checked against the server now
        (``StoreDataLost`` if the store lost it)."""
        self._call("now", [], [])  # every script's prelude checks the epoch
        return self._opened()

    def reset_epoch(self) -> EpochReset:
        reply = self._send("epoch_reset", [f"{self.prefix}epoch"], [uuid.uuid4().hex], "",
                           None)
        self._epoch = epoch = _epoch_of(reply)
        self._indexed = False  # the new record says (the reset carries the mark over)
        replaced, state, why = reply[3:6]
        return EpochReset(epoch=epoch, replaced=replaced or None,
                          lost=(why or "marked lost") if state == "lost" else None)

    # -- primitives (Store checks and decodes; these only run scripts and reads) ----------

    def _claim(self, key: str, owner: str, ttl: float, task: str | None) -> Row | None:
        nonce = uuid.uuid4().hex
        reply = self._call("claim", [*self._keys(key), f"{self.prefix}fence", self._running],
                           [owner, repr(ttl), task or "", nonce],
                           # Refused after a re-send: did the first send win? Its nonce would
                           # be on the row.
                           if_resent=lambda reply: reply or self._claimed_by(key, owner, nonce))
        return dict(zip(_CLAIMED, reply, strict=False)) if reply else None

    def _group_keys(self, group: str) -> list[str]:
        """A group's hash, slots set, waiters and their task info, arrival and hand-on times."""
        return [f"{self.prefix}{part}:{group}"
                for part in ("group", "slots", "waiters", "wtask", "wsince", "whanded")]

    def _claim_limited(self, key: str, owner: str, ttl: float, task: str | None, group: str,
                       limit: int | None, rate: Rate | None) -> Row | None:
        nonce = uuid.uuid4().hex

        def claimed_by(reply: Any) -> Any:
            # Refused after a re-send: did the first send win? Its nonce would be on the row.
            if reply:
                return reply
            won = self._claimed_by(key, owner, nonce)
            if won is None:
                return None
            # The slot token the first send was granted is on the row, as the reply had it.
            slot = self._hmget(self._keys(key)[0], ["slot"])[0]
            return ["granted", slot or "", "", "", "", *won]

        reply = self._call(
            "claim_limited",
            [*self._keys(key), f"{self.prefix}fence", self._running, *self._group_keys(group),
             f"{self.prefix}groups"],
            [owner, repr(ttl), task or "", nonce, group, "" if limit is None else str(limit),
             "" if rate is None else rate.text, "" if rate is None else repr(rate.interval)],
            if_resent=claimed_by)
        if not reply:
            return None
        verdict, number, running, lim, retry_at, *claimed = reply
        row: dict[str, Any] = {"verdict": verdict, "running": running, "lim": lim,
                               "retry_at": retry_at}
        if verdict == "granted":
            return {**row, **dict(zip(_CLAIMED, claimed, strict=False)), "slot": number}
        return {**row, "waiting": number}

    def _groups(self, group: str | None) -> list[str]:
        if group is not None:
            return [group]
        return sorted(self._smembers(f"{self.prefix}groups"))

    def _hand_on(self, group: str | None, grace: float, limit: int) -> list[Row]:
        head = f"{self.prefix}lease:"
        handed: list[Row] = []
        for grp in self._groups(group):
            if len(handed) >= limit:
                break
            reply = self._call("hand_on", self._group_keys(grp),
                               [grp, repr(grace), str(limit - len(handed))])
            handed += [{"grp": grp, "key": str(reply[i])[len(head):], "task": reply[i + 1],
                        "since": reply[i + 2]} for i in range(0, len(reply), 3)]
        return handed

    def _set_limit(self, group: str, changes: dict[str, Any]) -> None:
        args: list[str] = []
        for field, value in changes.items():
            args += [field, "\0" if value is None else
                     repr(value) if isinstance(value, float) else str(value)]
        self._call("limit_set", [self._group_keys(group)[0], f"{self.prefix}groups"],
                   [*args, group])

    def _limits(self, group: str | None, limit: int) -> list[Row]:
        rows: list[Row] = []
        for grp in self._groups(group)[:limit]:
            keys = self._group_keys(grp)
            if group is not None and not self._exists(keys[0]):
                continue
            fields = self._call("limit_info", keys[:3], [grp])
            names = ("task_limit", "task_rate", "set_limit", "set_rate", "updated_at",
                     "running", "waiting")
            rows.append({"grp": grp, **{name: (value if value is not False else None)
                                        for name, value in zip(names, fields, strict=True)}})
        return rows

    def _record_published(self, key: str, task: str, countdown: float) -> bool:
        return bool(self._call("record_published", [*self._keys(key), self._running],
                               [task, repr(countdown)],
                               # A re-send after a lost reply finds the first send's row.
                               if_resent=lambda written: written or self._published(key, task)))

    def _published(self, key: str, task: str) -> bool:
        """Is the row the one a record_published of ``task`` wrote (never claimed since)?"""
        state, recorded = self._hmget(self._keys(key)[0], ["state", "task"])
        return state == LeaseState.READY.value and recorded == task

    def _claimed_by(self, key: str, owner: str, nonce: str,
                    state: str | None = "running") -> list[str] | None:
        """Does the row carry this claim call's nonce (``state``: and that state)?"""
        row_state, row_owner, row_nonce, *rest = self._hmget(
            self._keys(key)[0], ["state", "owner", "nonce", *_CLAIMED])
        if (row_owner, row_nonce) != (owner, nonce) or (state is not None and row_state != state):
            return None
        *numbers, cancel = rest
        return [*(v or "0" for v in numbers), cancel or ""]

    def _renew_many(self, leases: Sequence[Lease], ttl: float) -> list[Row | None]:
        args: list[Any] = [repr(ttl)]
        for lease in leases:
            args += [lease.owner, str(lease.token)]
        reply = self._call("renew", [self._running,
                                     *(self._keys(lease.key)[0] for lease in leases)], args)
        return [{"expires_at": deadline, "cancel": cancel} if deadline else None
                for deadline, cancel in reply]

    def _fenced_write(self, lease: Lease, state: LeaseState, *, result: str = "",
                      reason: str | None = None, delay: float = 0.0,
                      settle_within: float | None = None, task: str | None = None,
                      counted: bool = True) -> bool:
        return bool(self._call("fenced_write", [self._keys(lease.key)[0], self._running], [
            lease.owner, str(lease.token), state.value, result, reason or "", repr(delay),
            "" if settle_within is None else repr(settle_within), task or "",
            "" if counted else "1"],
            if_resent=lambda ok: ok or self.settled_by(lease, state)))

    def _finish(self, lease: Lease, result: str, settle_within: float | None) -> bool:
        return self._fenced_write(lease, LeaseState.DONE, result=result,
                                  settle_within=settle_within)

    def _finish_and_claim(self, finished: Lease, result: str, key: str, owner: str,
                          ttl: float, task: str | None) -> tuple[bool, Row | None]:
        nonce = uuid.uuid4().hex

        def if_resent(reply: Any) -> Any:
            # The first send may have run: then its finish is on the row under our owner and
            # token, and its claim's nonce is on the claimed row.
            accepted, claimed = reply
            return [int(accepted) or self.settled_by(finished, LeaseState.DONE),
                    claimed or self._claimed_by(key, owner, nonce)]

        accepted, claimed = self._call("finish_and_claim", [
            self._keys(finished.key)[0], self._running, *self._keys(key),
            f"{self.prefix}fence"], [finished.owner, str(finished.token), result, owner,
                                     repr(ttl), task or "", nonce], if_resent=if_resent)
        return bool(int(accepted)), dict(zip(_CLAIMED, claimed, strict=False)) if claimed else None

    def _release(self, lease: Lease, delay: float, reason: str | None, task: str | None,
                 counted: bool) -> bool:
        return self._fenced_write(lease, LeaseState.READY, reason=reason, delay=delay,
                                  task=task, counted=counted)

    def _kill(self, lease: Lease, reason: str, settle_within: float | None,
              error: str | None) -> bool:
        return self._fenced_write(lease, LeaseState.DEAD, result=error or "", reason=reason,
                                  settle_within=settle_within)

    def _checkpoint(self, lease: Lease, data: str) -> bool:
        # Re-sent after a lost reply, the same write is judged again: still ours, accepted.
        return bool(self._call("checkpoint", [self._keys(lease.key)[0]], [
            lease.owner, str(lease.token), data]))

    def _cancel(self, key: str, reason: str) -> bool:
        lease_hash, counter = self._keys(key)
        return bool(self._call("cancel", [lease_hash, self._running, counter], [reason]))

    def _settle_many(self, leases: Sequence[Lease]) -> list[bool]:
        args: list[Any] = []
        for lease in leases:
            args += [lease.owner, str(lease.token)]
        # Idempotent: a row this owner already settled answers 1, so a re-send is harmless.
        reply = self._call("settle_many", [self._running,
                                           *(self._keys(lease.key)[0] for lease in leases)], args)
        return [bool(int(ok)) for ok in reply]

    def _claim_settlement(self, key: str, owner: str, ttl: float) -> Row | None:
        nonce = uuid.uuid4().hex
        reply = self._call("claim_settlement", [self._keys(key)[0], self._running],
                           [owner, repr(ttl), nonce],
                           if_resent=lambda reply: reply or self._claimed_by(
                               key, owner, nonce, state=None))
        return dict(zip(_CLAIMED[:5], reply, strict=False)) if reply else None

    # -- operator actions ---------------------------------------------------------------------

    def _force_release(self, key: str, reason: str) -> bool:
        return bool(self._call("force_release", [self._keys(key)[0], self._running], [reason]))

    def _requeue(self, key: str, reason: str) -> bool:
        return bool(self._call("requeue", [self._keys(key)[0], self._running], [reason]))

    def _purge(self, key: str) -> bool:
        return bool(self._call("purge", [*self._keys(key), self._running], []))

    def _purge_older_than(self, seconds: float, limit: int | None) -> int:
        if limit is not None:
            # Retention: the oldest, from the done and dead indexes. On a prefix still being
            # indexed, the rows indexed so far (the sweeper's prune builds a slice a call).
            self._indexes_ready(budget=BUILD_SLICE)
            return self._prune(seconds, limit)
        if not self._indexes_ready(budget=None):
            # All of them (an operator's purge) while another process builds the indexes:
            # every hash, those not indexed yet included.
            return sum(int(self._call("purge_old", [self._keys(key)[0], self._running],
                                      [repr(seconds)]))
                       for key in self._lease_keys())
        total = 0  # in batches, each its own short script, until one finds nothing to delete
        while purged := self._prune(seconds, PURGE_BATCH):
            total += purged
        return total

    def _prune(self, seconds: float, limit: int) -> int:
        return int(self._call("prune", [self._running], [repr(seconds), str(limit)]))

    def _lease_keys(self) -> list[str]:
        """Every lease key in the store."""
        return self._scan(f"{self.prefix}lease:")

    def _get(self, key: str) -> Row | None:
        return _lease_row(key, self._hgetall(self._keys(key)[0]))

    # -- operator reads: from the state indexes (prelude.lua), SCAN only on a prefix that the
    # version before wrote and whose indexes are still being built by another process ----

    def _indexes_ready(self, *, budget: float | None) -> bool:
        """Are the state indexes complete? If not, build them first (for ``budget`` seconds;
        None: to the end), unless another process is building them."""
        if not self._indexed:
            self._opened()  # the epoch record says (a new store is indexed from the start)
        if not self._indexed:
            indexed, cursor = self._hmget(f"{self.prefix}epoch", ["indexed", "index_cursor"])
            if indexed == "1":
                self._indexed = True
            else:
                self._build_indexes(int(cursor or 0), budget)
        return self._indexed

    def _build_indexes(self, cursor: int, budget: float | None) -> None:
        """SCAN the prefix from ``cursor`` and index each page's hashes (index_build.lua says
        why this is safe while workers write), until the SCAN is complete or ``budget``
        seconds have passed (at least one page), or another process holds the build."""
        lock = f"{self.prefix}index:building"
        lease_head, effect_head = f"{self.prefix}lease:", f"{self.prefix}effect:"
        started = time.monotonic()
        while True:
            following, names = self._scan_page(cursor)
            leases = [name for name in names if name.startswith(lease_head)]
            effects = [name for name in names if name.startswith(effect_head)]
            last = following != 0 and budget is not None and (
                time.monotonic() - started >= budget)
            reply = int(self._call("index_build", [lock, *leases, *effects], [
                self._builder, str(BUILD_LOCK_MS), str(following), str(len(leases)),
                "1" if last else ""]))
            if reply == 2:
                self._indexed = True
                logger.info("redis lease store at %s (prefix %r): state indexes built",
                            self._where, self.prefix)
                return
            if reply == 0 or last:
                return
            cursor = following

    def _newest(self, names: Sequence[str], page: int) -> Iterator[list[str]]:
        """The members of the sorted sets ``names``, highest score first across them, ``page``
        at a time, the pages doubling up to ``_PAGE_MAX`` (a filter that passes over most
        rows costs round trips by the thousand rows, not by the page of ``limit``)."""
        buffers = {name: collections.deque[tuple[str, float]]() for name in names}
        offsets = dict.fromkeys(names, 0)
        exhausted: set[str] = set()
        while True:
            empty = [name for name in names if not buffers[name] and name not in exhausted]
            if empty:
                for name, members in zip(empty, self._zrevrange_many(
                        empty, [offsets[name] for name in empty], page), strict=True):
                    offsets[name] += len(members)
                    buffers[name].extend(members)
                    if len(members) < page:
                        exhausted.add(name)
            out: list[str] = []
            # A member is next only while every set that may hold more has one in hand.
            while len(out) < page and all(buffers[name] or name in exhausted
                                          for name in names):
                held = [name for name in names if buffers[name]]
                if not held:
                    break
                best = max(held, key=lambda name: buffers[name][0][1])
                out.append(buffers[best].popleft()[0])
            if out:
                yield out
                page = min(2 * page, max(page, _PAGE_MAX))
            elif all(name in exhausted and not buffers[name] for name in names):
                return

    def _from_index(self, names: Sequence[str], head: str, limit: int,
                    keep: Callable[[str, dict[str, str]], Row | None],
                    key_prefix: str | None = None) -> list[Row]:
        """Read the hashes of the indexes ``names`` newest first, until ``limit`` of them are
        kept (``keep``: the row, or None to pass over one that changed since it was listed,
        or that a filter leaves out). ``key_prefix``: only keys that start with it are read
        at all (the members are the hashes' names: a filter on the key costs no HGETALL)."""
        rows: list[Row] = []
        seen: set[str] = set()  # a hash that moved between two indexes as they were read
        wanted = head + (key_prefix or "")
        for members in self._newest(names, limit):
            members = [name for name in members if name not in seen and name.startswith(wanted)]
            seen.update(members)
            for name, fields in zip(members, self._hgetall_many(members), strict=True):
                if fields and (row := keep(name[len(head):], fields)) is not None:
                    rows.append(row)
                    if len(rows) == limit:
                        return rows
        return rows

    def _find(self, state: LeaseState | None, prefix: str | None, owner: str | None,
              limit: int) -> list[Row]:
        if not self._indexes_ready(budget=None):
            return self._scan_find(state, prefix, owner, limit)
        states = _LEASE_STATES if state is None else (state.value,)

        def keep(key: str, fields: dict[str, str]) -> Row | None:
            # (The key prefix is applied to the index members before any row is read.)
            row = _lease_row(key, fields)
            if (row is None or row["state"] not in states
                    or (owner is not None and not owned_by(row.get("owner"), owner))):
                return None
            return row

        rows = self._from_index([f"{self.prefix}index:lease:{s}" for s in states],
                                f"{self.prefix}lease:", limit, keep, key_prefix=prefix)
        # As listed, unless a row moved on between the index's read and its own.
        rows.sort(key=lambda row: float(row.get("updated_at") or 0.0), reverse=True)
        return rows

    def _stats(self) -> list[Row]:
        if not self._indexes_ready(budget=None):
            return self._scan_stats()
        *counts, expired = self._call("stats", [], [])
        return [{"state": state, "total": int(total),
                 "expired": int(expired) if state == LeaseState.RUNNING.value else 0}
                for state, total in zip(_LEASE_STATES, counts, strict=True) if int(total)]

    # The reads of a prefix whose indexes another process is still building (SCAN: every key).

    def _scan_find(self, state: LeaseState | None, prefix: str | None, owner: str | None,
                   limit: int) -> list[Row]:
        rows = [row for key in self._lease_keys()
                if (prefix is None or key.startswith(prefix))
                and (row := self._get(key)) is not None
                and (state is None or row["state"] == state.value)
                and (owner is None or owned_by(row.get("owner"), owner))]
        rows.sort(key=lambda row: float(row.get("updated_at") or 0.0), reverse=True)
        return rows[:limit]

    def _scan_stats(self) -> list[Row]:
        now = self.now()
        by_state: dict[str, dict[str, Any]] = {}
        for key in self._lease_keys():
            row = self._get(key)
            if row is None:
                continue
            counts = by_state.setdefault(row["state"], {"state": row["state"], "total": 0,
                                                        "expired": 0})
            counts["total"] += 1
            counts["expired"] += (row["state"] == LeaseState.RUNNING.value
                                  and float(row.get("expires_at") or 0.0) <= now)
        return list(by_state.values())

    def _sweep_expired(self, limit: int, grace: float, nonce: str) -> list[str]:
        # One script over the attention index: the cost follows what is due, not the store
        # size. A re-sent sweep finds its first send's marks set: those rows come back one
        # grace period later.
        hashes = self._call("sweep", [self._running], [str(limit), repr(grace), nonce])
        head = f"{self.prefix}lease:"
        return [str(name)[len(head):] for name in hashes]

    def _sweep_unmark(self, key: str, token: int) -> bool:
        return bool(self._call("sweep_unmark", [self._keys(key)[0], self._running],
                               [str(token)]))

    # -- history: a capped list per key (it goes with the key's hash) and one across keys ---

    def _record_history_many(self, entries: list[HistoryEntry]) -> None:
        # One script call per batch: packing a command costs the writer thread (and so the
        # tasks sharing its GIL) far more than packing one more argument.
        args: list[Any] = [str(HISTORY_PER_KEY), str(HISTORY_RECENT)]
        for entry in entries:
            args += [entry.key, json.dumps(dataclasses.asdict(entry), separators=(",", ":"))]
        self._call("history_append", [f"{self.prefix}history"], args)

    def _history_list(self, name: str, start: int, end: int) -> list[HistoryEntry]:
        return [HistoryEntry(**json.loads(item)) for item in self._lrange(name, start, end)]

    def _history(self, key: str, limit: int) -> list[HistoryEntry]:
        return self._history_list(f"{self.prefix}history:{key}", -limit, -1)

    def _history_many(self, keys: list[str], limit: int) -> dict[str, list[HistoryEntry]]:
        lists = self._lrange_many([f"{self.prefix}history:{key}" for key in keys], -limit, -1)
        return {key: [HistoryEntry(**json.loads(item)) for item in items]
                for key, items in zip(keys, lists, strict=True)}

    def _recent_history(self, events: list[str] | None, limit: int) -> list[HistoryEntry]:
        entries = self._history_list(f"{self.prefix}history", 0, HISTORY_RECENT - 1)
        wanted = None if events is None else set(events)
        return [e for e in entries if wanted is None or e.event in wanted][:limit]

    def _prune_history(self, cutoff: float, limit: int) -> int:
        # Nothing to prune by age: each key's list is capped and deleted with its hash (by
        # retention or purge), and the list across keys keeps the latest HISTORY_RECENT.
        return 0

    # -- effect receipts --------------------------------------------------------------------

    def _effect_key(self, key: str) -> list[str]:
        return [f"{self.prefix}effect:{key}"]

    def _effect_insert(self, key: str, fingerprint: str, lease: Lease | None) -> bool | None:
        return self._effect_write("effect_insert", key, lease, [fingerprint])

    def _effect_restart(self, key: str, version: int, lease: Lease | None) -> bool | None:
        return self._effect_write("effect_restart", key, lease, [str(version)])

    def _effect_write(self, script: str, key: str, lease: Lease | None,
                      leading: list[str]) -> bool | None:
        """Run a receipt script fenced on ``lease`` (-1 back: it was not current, None)."""
        who = lease_params(lease)
        lease_hash = self._keys(lease.key)[0] if lease is not None else f"{self.prefix}none"
        reply = int(self._call(script, [*self._effect_key(key), lease_hash], [
            *leading, who["lease_key"] or "", "" if lease is None else str(lease.token),
            who["lease_owner"] or ""]))
        return None if reply == -1 else reply == 1

    def _effect_get(self, key: str) -> Row | None:
        fields = self._hgetall(self._effect_key(key)[0])
        return {"key": key, **fields} if fields else None

    def _effect_find(self, state: EffectState | None, limit: int) -> list[Row]:
        if not self._indexes_ready(budget=None):
            return self._scan_effect_find(state, limit)
        states = _EFFECT_STATES if state is None else (state.value,)

        def keep(key: str, fields: dict[str, str]) -> Row | None:
            return {"key": key, **fields} if fields.get("state") in states else None

        rows = self._from_index([f"{self.prefix}index:effect:{s}" for s in states],
                                f"{self.prefix}effect:", limit, keep)
        rows.sort(key=lambda row: float(row["updated_at"]), reverse=True)
        return rows

    def _scan_effect_find(self, state: EffectState | None, limit: int) -> list[Row]:
        rows = [row for key in self._scan(f"{self.prefix}effect:")
                if (row := self._effect_get(key)) is not None
                and (state is None or row["state"] == state.value)]
        rows.sort(key=lambda row: float(row["updated_at"]), reverse=True)
        return rows[:limit]

    def _effect_update(self, key: str, version: int, state: EffectState,
                       result: str | None) -> bool:
        return bool(self._call("effect_update", self._effect_key(key),
                               [str(version), state.value, result or ""]))

    def _effect_delete(self, key: str, version: int) -> bool:
        return bool(self._call("effect_delete", self._effect_key(key), [str(version)]))

    def now(self) -> float:
        return float(self._call("now", [], []))

    def _diagnose(self) -> list[Finding]:
        return server_findings(self._client, self._where)

    def close(self) -> None:
        self._caller.close()
        self._client.close()


class _EpochChanged(Exception):
    """An operator reset the epoch since this store object opened it: the script wrote
    nothing, and goes again in the new epoch."""


def _lease_row(key: str, fields: dict[str, str]) -> Row | None:
    """A lease hash's fields as the row ``_get`` answers (None: no hash)."""
    if not fields:
        return None
    row: dict[str, Any] = {**fields, "key": key}
    if "task" not in row and "task_id" in row:
        # A settled done row keeps only its task id and context (drop_task in prelude.lua).
        row["task"] = task_id_only(row["task_id"], row.get("context"))
    return row


def _epoch_of(reply: Sequence[Any]) -> StoreEpoch:
    epoch_id, floor, created_at = reply[:3]
    return StoreEpoch(id=str(epoch_id), floor=int(floor), created_at=float(created_at))


def _pattern(head: str) -> str:
    """A SCAN pattern matching the names that start with ``head`` (its glob characters
    escaped)."""
    return "".join(f"[{c}]" if c in "*?[]\\" else c for c in head) + "*"
