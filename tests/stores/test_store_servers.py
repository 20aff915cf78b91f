"""The server stores (PostgreSQL, Redis) across machines: the server's clock is the authority,
bad connection input fails fast with a StoreError, and a lost connection is replaced.

Only 127.0.0.1 is ever contacted: the "unreachable" server is a free local port, the "hanging"
one a socket of this test's own that accepts and never answers, and the connection that loses a
reply is a proxy of this test's own in front of the local PostgreSQL.
"""

from __future__ import annotations

import base64
import pickle
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest
import redis

from lease_celery import Lease, LeaseState, Store, StoreError, open_store
from tests.support.policy_helpers import free_port
from tests.support.proxy import ReplyDroppingProxy
from tests.support.servers import PG_DSN, REDIS_HOST, REDIS_PORT, REDIS_STORE_DB

SHIFT = 3600.0  # how far off the shifted worker's clock runs, in seconds
CLAIM_TTL = 1.5
SERVERS = pytest.mark.parametrize("store_url", ["postgres", "redis"], indirect=True)

# -- a worker process whose clock is off ------------------------------------------------------


# The child is a plain ``python -c`` process, not a multiprocessing one: freezegun leaves the
# real clock to code called from ``multiprocessing`` frames (its default ignore list).
_CHILD = """
import base64, pickle, sys, time, traceback
from datetime import datetime, timedelta, timezone
from freezegun import freeze_time
from lease_celery import open_store

store = open_store(sys.argv[1])
store.get("warm-up")  # connect before the first shifted call
for line in sys.stdin:
    op, shift, args, kwargs = pickle.loads(base64.b64decode(line))
    try:
        with freeze_time(datetime.now(timezone.utc) + timedelta(seconds=shift), tick=True):
            local = time.time()
            reply = ("ok", local, getattr(store, op)(*args, **kwargs))
    except BaseException:
        reply = ("error", 0.0, traceback.format_exc())
    print(base64.b64encode(pickle.dumps(reply)).decode(), flush=True)
store.close()
"""


class ShiftedWorker:
    """A worker process with a store of its own (no injected clock) that runs each store call
    inside ``freeze_time(real now + shift, tick=True)``: its clock runs ``shift`` seconds off."""

    def __init__(self, url: str) -> None:
        self._proc = subprocess.Popen([sys.executable, "-c", _CHILD, url], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True)

    def __enter__(self) -> ShiftedWorker:
        return self

    def __exit__(self, *exc_info: object) -> None:
        assert self._proc.stdin is not None
        self._proc.stdin.close()
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(timeout=5)
        if self._proc.stdout is not None:
            self._proc.stdout.close()

    def call(self, op: str, shift: float, *args: Any, **kwargs: Any) -> tuple[float, Any]:
        """``store.<op>(*args, **kwargs)`` in the child under a clock ``shift`` seconds off;
        returns (the child's own time.time() at the call, the result)."""
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._proc.stdin.write(base64.b64encode(pickle.dumps((op, shift, args, kwargs))).decode()
                               + "\n")
        self._proc.stdin.flush()
        line = self._proc.stdout.readline()
        assert line, f"the shifted worker exited (code {self._proc.poll()}) during {op}"
        status, local, result = pickle.loads(base64.b64decode(line))
        assert status == "ok", result
        return local, result


def _wait_for_server_time(store: Store, instant: float, *, timeout: float = 15.0) -> None:
    """Sleep until the store's (server's) clock has passed ``instant``."""
    deadline = time.monotonic() + timeout
    while store.now() <= instant:
        assert time.monotonic() < deadline, f"server clock never reached {instant}"
        time.sleep(0.05)


@SERVERS
def test_worker_clock_an_hour_off_decides_neither_deadline_nor_winner(store_url: str) -> None:
    """A worker process whose clock runs an hour fast claims one key, and an hour slow another
    (freezegun in a subprocess; store opened without an injected clock), ttl 1.5 s: each
    deadline lies between the server's now + ttl read just before and just after the claim
    (not an hour off); the child really saw its own clock an hour off; the child's renew also
    sets server-now + ttl. An unshifted owner's claim during the ttl is refused; once the
    server clock passes the deadline it takes over (token 2) and the shifted worker's renew and
    finish are refused, leaving the unshifted owner's row unchanged."""
    with open_store(store_url) as authority, ShiftedWorker(store_url) as worker:
        leases: dict[str, Lease] = {}
        for shift, key in ((SHIFT, "report:fast"), (-SHIFT, "report:slow")):
            server_before = authority.now()
            local, lease = worker.call("claim", shift, key, owner=f"shifted{shift:+.0f}",
                                       ttl=CLAIM_TTL)
            server_after = authority.now()
            assert abs(local - server_before - shift) < 30, "the child's clock was not shifted"
            assert lease is not None
            assert server_before + CLAIM_TTL - 1e-3 <= lease.expires_at, (key, server_before)
            assert lease.expires_at <= server_after + CLAIM_TTL + 1e-3, (key, server_after)

            server_before = authority.now()
            _, renewed = worker.call("renew", shift, lease, ttl=CLAIM_TTL)
            server_after = authority.now()
            assert renewed is not None
            assert server_before + CLAIM_TTL - 1e-3 <= renewed.expires_at
            assert renewed.expires_at <= server_after + CLAIM_TTL + 1e-3
            leases[key] = renewed

            assert authority.claim(key, owner="unshifted", ttl=30) is None
            record = authority.get(key)
            assert record is not None and record.owner == f"shifted{shift:+.0f}"

        _wait_for_server_time(authority, max(lease.expires_at for lease in leases.values()))
        for shift, key in ((SHIFT, "report:fast"), (-SHIFT, "report:slow")):
            taken = authority.claim(key, owner="unshifted", ttl=30)
            assert taken is not None and taken.token == leases[key].token + 1
            before = authority.get(key)
            _, renewed = worker.call("renew", shift, leases[key], ttl=CLAIM_TTL)
            assert renewed is None
            _, finished = worker.call("finish", shift, leases[key], {"stale": True})
            assert finished is False
            assert authority.get(key) == before
            assert before is not None and (before.owner, before.state) == (
                "unshifted", LeaseState.RUNNING)


@SERVERS
def test_fast_worker_clock_cannot_take_or_purge_a_live_lease(store_url: str) -> None:
    """A lease held by an unshifted owner for 30 s looks an hour expired to a worker whose
    clock is an hour fast; that worker's claim is refused and its purge returns False, and
    the row is unchanged: the server's clock decides."""
    with open_store(store_url) as authority, ShiftedWorker(store_url) as worker:
        held = authority.claim("report:held", owner="unshifted", ttl=30)
        assert held is not None
        before = authority.get("report:held")
        local, stolen = worker.call("claim", SHIFT, "report:held", owner="fast", ttl=30)
        assert abs(local - time.time() - SHIFT) < 30, "the child's clock was not shifted"
        assert stolen is None
        _, purged = worker.call("purge", SHIFT, "report:held")
        assert purged is False
        assert authority.get("report:held") == before
        assert authority.finish(held, "mine") is True


def test_sqlite_authority_clock_is_the_host_clock(sqlite_url: str) -> None:
    """Contrast, documented rather than endorsed: SQLite's authority clock is the clock of the
    process calling the store (time.time()), which is why SQLite is for workers on one host
    sharing one clock. A process whose clock is an hour fast writes a deadline an hour late
    (the unshifted owner's claim is refused for that hour), and sees an unshifted owner's live
    30 s lease as expired and takes it over."""
    with open_store(sqlite_url) as host_store, ShiftedWorker(sqlite_url) as worker:
        host_now = time.time()
        local, lease = worker.call("claim", SHIFT, "report:fast", owner="fast", ttl=CLAIM_TTL)
        assert abs(local - host_now - SHIFT) < 30, "the child's clock was not shifted"
        assert lease is not None
        assert lease.expires_at - host_now == pytest.approx(SHIFT + CLAIM_TTL, abs=30)
        assert host_store.claim("report:fast", owner="unshifted", ttl=30) is None

        held = host_store.claim("report:held", owner="unshifted", ttl=30)
        assert held is not None
        _, stolen = worker.call("claim", SHIFT, "report:held", owner="fast", ttl=30)
        assert stolen is not None and stolen.token == held.token + 1
        assert host_store.finish(held, "too late") is False


# -- bad connection input ---------------------------------------------------------------------


@pytest.fixture(name="free_port")
def free_port_fixture() -> int:
    """A port on 127.0.0.1 with nothing listening on it."""
    return free_port()


class SilentServer:
    """A TCP server on 127.0.0.1 that accepts connections and never says a word."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0), backlog=64)
        self.listener.settimeout(0.1)
        self.port: int = self.listener.getsockname()[1]
        self.accepted: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.accepted.append(conn)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.listener.close()
        for conn in self.accepted:
            conn.close()


@pytest.fixture
def silent_server() -> Iterator[SilentServer]:
    server = SilentServer()
    yield server
    server.close()


def _kind(store_url: str) -> str:
    return "postgres" if store_url.startswith("postgres") else "redis"


def _url(kind: str, *, port: int | None = None, userinfo: str = "", db: str | None = None,
         query: str = "") -> str:
    """A store URL on 127.0.0.1 (the test server's port unless ``port``)."""
    if kind == "postgres":
        pg = urlsplit(PG_DSN)
        netloc = f"{userinfo}{pg.hostname}:{port or pg.port or 5432}"
        return urlunsplit(("postgresql", netloc, f"/{db or pg.path.lstrip('/')}", query, ""))
    netloc = f"{userinfo}{REDIS_HOST}:{port or REDIS_PORT}"
    return urlunsplit(("redis", netloc, f"/{db or REDIS_STORE_DB}", query, ""))


DRIVER_ERRORS: dict[str, type[BaseException]] = {
    "postgres": psycopg.Error,
    "redis": redis.RedisError,
}


def _first_use_fails(url: str, *, within: float) -> StoreError:
    """Open the store and use it (claim, then get): each raises StoreError wrapping the
    driver's error, within ``within`` seconds; return the claim's error."""
    errors: list[StoreError] = []
    for use in ("claim", "get"):
        started = time.monotonic()
        # the server stores connect lazily: open and first use are both inside the raises
        with pytest.raises(StoreError) as excinfo, open_store(url) as store:
            if use == "claim":
                store.claim("report:1", owner="w", ttl=10)
            else:
                store.get("report:1")
        elapsed = time.monotonic() - started
        assert elapsed < within, f"{use} took {elapsed:.1f}s to fail"
        errors.append(excinfo.value)
    return errors[0]


@SERVERS
def test_nothing_listening_fails_fast_naming_host_and_port(store_url: str, free_port: int
                                                          ) -> None:
    """A URL whose port on 127.0.0.1 has nothing listening: first use raises StoreError
    naming 127.0.0.1 and the port within 5 s, with the driver's error as __cause__."""
    kind = _kind(store_url)
    error = _first_use_fails(_url(kind, port=free_port), within=5)
    assert f"127.0.0.1:{free_port}" in str(error)
    assert isinstance(error.__cause__, DRIVER_ERRORS[kind]), repr(error.__cause__)


@SERVERS
def test_server_that_never_answers_fails_within_the_timeout(
    store_url: str, silent_server: SilentServer
) -> None:
    """A server that accepts TCP connections and never answers, with a 1 s connect timeout
    (PostgreSQL connect_timeout=1; Redis socket_connect_timeout=1&socket_timeout=1): first use
    raises StoreError naming host and port in well under 15 s — no hang — with the driver's
    timeout as __cause__; the silent server did receive the connection."""
    kind = _kind(store_url)
    query = ("connect_timeout=1" if kind == "postgres"
             else "socket_connect_timeout=1&socket_timeout=1")
    error = _first_use_fails(_url(kind, port=silent_server.port, query=query), within=15)
    assert f"127.0.0.1:{silent_server.port}" in str(error)
    assert isinstance(error.__cause__, DRIVER_ERRORS[kind]), repr(error.__cause__)
    assert silent_server.accepted, "the store never connected to the silent server"


@SERVERS
def test_wrong_credentials_are_named(store_url: str) -> None:
    """A role that does not exist (PostgreSQL) or a user/password Redis does not know: first
    use raises StoreError naming the problem, with the driver's error as __cause__."""
    kind = _kind(store_url)
    if kind == "postgres":
        error = _first_use_fails(_url(kind, userinfo="nosuchrole@"), within=5)
        assert 'role "nosuchrole" does not exist' in str(error)
        assert isinstance(error.__cause__, psycopg.OperationalError)
    else:
        error = _first_use_fails(_url(kind, userinfo="nouser:pw@"), within=5)
        assert "invalid username-password pair" in str(error)
        assert isinstance(error.__cause__, redis.AuthenticationError)


@SERVERS
def test_missing_database_is_named(store_url: str) -> None:
    """A database that does not exist (PostgreSQL /nosuchdb, Redis db 99): first use raises
    StoreError naming it, with the driver's error as __cause__."""
    kind = _kind(store_url)
    if kind == "postgres":
        error = _first_use_fails(_url(kind, db="nosuchdb"), within=5)
        assert 'database "nosuchdb" does not exist' in str(error)
        assert isinstance(error.__cause__, psycopg.OperationalError)
    else:
        error = _first_use_fails(_url(kind, db="99"), within=5)
        assert "DB index is out of range" in str(error)
        assert isinstance(error.__cause__, redis.ResponseError)


# -- PostgreSQL: losing the connection ---------------------------------------------------------


def _backends(application_name: str) -> set[int]:
    with psycopg.connect(PG_DSN, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE application_name = %s "
            "AND pid <> pg_backend_pid()", (application_name,)).fetchall()
    return {int(pid) for (pid,) in rows}


def _terminate(application_name: str) -> set[int]:
    """Terminate this test's own backends (found by application_name); wait until gone."""
    with psycopg.connect(PG_DSN, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT pid, pg_terminate_backend(pid, 5000) FROM pg_stat_activity "
            "WHERE application_name = %s AND pid <> pg_backend_pid()",
            (application_name,)).fetchall()
    return {int(pid) for pid, _ in rows}


def test_postgres_store_reconnects_after_its_connections_are_killed(postgres_url: str) -> None:
    """The server terminates every backend of the store (pg_terminate_backend, only those with
    this test's application_name) before each of claim, renew, get and finish: each call
    still succeeds with the right answer within 10 s, on a new backend."""
    app = f"lease_test_{uuid.uuid4().hex[:8]}"
    clock_value = [100.0]
    with open_store(f"{postgres_url}&application_name={app}",
                    clock=lambda: clock_value[0]) as store:
        assert store.claim("report:warm", owner="w", ttl=10) is not None
        lease: Lease | None = None
        killed: set[int] = set()
        for step in ("claim", "renew", "get", "finish"):
            victims = _terminate(app)
            assert victims, f"{step}: the store had no connection to terminate"
            killed |= victims
            started = time.monotonic()
            if step == "claim":
                lease = store.claim("report:1", owner="w", ttl=10)
                assert lease is not None and lease.token == 1
            elif step == "renew":
                assert lease is not None
                clock_value[0] = 105.0
                lease = store.renew(lease, ttl=10)
                assert lease is not None and lease.expires_at == 115.0
            elif step == "get":
                record = store.get("report:1")
                assert record is not None and record.expires_at == 115.0
            else:
                assert lease is not None
                assert store.finish(lease, {"ok": True}) is True
            assert time.monotonic() - started < 10, f"{step} took too long to reconnect"
            alive = _backends(app)
            assert alive and not alive & killed, (step, alive, killed)
        record = store.get("report:1")
        assert record is not None
        assert (record.state, record.token, record.result) == (LeaseState.DONE, 1, {"ok": True})


@pytest.fixture
def pg_proxy(postgres_url: str) -> Iterator[tuple[str, ReplyDroppingProxy]]:
    """A store URL (this test's schema) that reaches PostgreSQL through ReplyDroppingProxy."""
    pg = urlsplit(PG_DSN)
    proxy = ReplyDroppingProxy((pg.hostname or "127.0.0.1", pg.port or 5432))
    parts = urlsplit(postgres_url)
    url = urlunsplit((parts.scheme, f"127.0.0.1:{proxy.port}", parts.path,
                      f"{parts.query}&sslmode=disable", ""))
    yield url, proxy
    proxy.close()




@pytest.mark.parametrize(
    ("op", "pattern"),
    [
        pytest.param("claim", b"INSERT INTO"),
        pytest.param("renew", b"unnest("),
        pytest.param("finish", b"SET state = 'done'"),
        pytest.param("release", b"SET state = 'ready'"),
    ],
)
def test_postgres_write_whose_reply_is_lost_is_not_reported_as_refused(
    pg_proxy: tuple[str, ReplyDroppingProxy], op: str, pattern: bytes
) -> None:
    """The connection dies after the server committed a claim / renew / finish / release but
    before its reply arrived. The caller must then learn the outcome or that it is unknown:
    the call returns what the server did (the claimed or renewed Lease matching the row, True)
    or raises StoreError — it must not report a refusal (None / False) for a write the store
    accepted, which would orphan a claim until it expires, report an accepted result as stale,
    or a release as not current."""
    url, proxy = pg_proxy
    clock = [100.0]
    with open_store(url, clock=lambda: clock[0]) as store:
        lease = store.claim("report:held", owner="w", ttl=10)
        assert lease is not None
        key = "report:fresh" if op == "claim" else "report:held"
        clock[0] = 105.0
        proxy.drop_reply_to(pattern)
        try:
            if op == "claim":
                outcome: Any = store.claim(key, owner="w", ttl=10)
            elif op == "renew":
                outcome = store.renew(lease, ttl=10)
            elif op == "finish":
                outcome = store.finish(lease, {"n": 1})
            else:
                outcome = store.release(lease)
        except StoreError:
            outcome = "unknown"
        assert proxy.dropped == 1, "the reply was not dropped"
        record = store.get(key)
        assert record is not None
        committed = {  # the first attempt's write, which the server committed
            "claim": (LeaseState.RUNNING, "w", 1, 115.0, None),
            "renew": (LeaseState.RUNNING, "w", 1, 115.0, None),
            "finish": (LeaseState.DONE, "w", 1, 105.0, {"n": 1}),
            "release": (LeaseState.READY, "w", 1, 105.0, None),
        }[op]
        assert (record.state, record.owner, record.token, record.expires_at,
                record.result) == committed
        if outcome == "unknown":
            return
        if op in ("claim", "renew"):
            assert outcome is not None, f"{op} reported refused; the row is {record}"
            assert (outcome.token, outcome.expires_at) == (record.token, record.expires_at)
        else:
            assert outcome is True, f"{op} reported refused; the row is {record}"


def test_postgres_sweep_whose_reply_is_lost_still_reports_the_marked_lease(
    pg_proxy: tuple[str, ReplyDroppingProxy]
) -> None:
    """The sweep's marks commit but its reply is lost; the re-sent sweep finds nothing left to
    mark. The expired lease must still be reported (to be re-published), not dropped for good."""
    url, proxy = pg_proxy
    clock = [100.0]
    task = {"task": "proj.t", "args": [], "kwargs": {}, "options": {"task_id": "t-1"}}
    with open_store(url, clock=lambda: clock[0]) as store:
        assert store.claim("report:swept", owner="w", ttl=10, task=task) is not None
        clock[0] = 110.0
        proxy.drop_reply_to(b"SKIP LOCKED")
        swept = store.sweep_expired()
        assert proxy.dropped == 1, "the reply was not dropped"
        assert [r.key for r in swept] == ["report:swept"]


def test_postgres_resent_sweep_reports_only_its_own_marks(
    pg_proxy: tuple[str, ReplyDroppingProxy]
) -> None:
    """Issue 9 (re-publish storms): rows an earlier sweep already marked are not reported again
    by a later sweep whose reply was lost and re-sent: only the rows that call marked."""
    url, proxy = pg_proxy
    clock = [100.0]
    task = {"task": "proj.t", "args": [], "kwargs": {}, "options": {"task_id": "t-1"}}
    with open_store(url, clock=lambda: clock[0]) as store:
        for key in ("earlier:1", "earlier:2"):
            assert store.claim(key, owner="w", ttl=10, task=task) is not None
        clock[0] = 110.0
        assert sorted(r.key for r in store.sweep_expired()) == ["earlier:1", "earlier:2"]
        assert store.claim("later", owner="w", ttl=10, task=task) is not None
        clock[0] = 120.0  # the earlier marks still hold (grace 60 s); "later" expired now
        proxy.drop_reply_to(b"SKIP LOCKED")
        swept = store.sweep_expired()
        assert proxy.dropped == 1, "the reply was not dropped"
        assert [r.key for r in swept] == ["later"]


def test_postgres_settle_whose_reply_is_lost_is_still_reported_settled(
    pg_proxy: tuple[str, ReplyDroppingProxy]
) -> None:
    """The owner's settle confirmation commits but its reply is lost: the re-sent one is
    refused by the row (no longer settling), yet the owner is told it settled."""
    url, proxy = pg_proxy
    clock = [100.0]
    with open_store(url, clock=lambda: clock[0]) as store:
        lease = store.claim("settle:lost", owner="w", ttl=10)
        assert lease is not None
        assert store.finish(lease, {"n": 1}, settle_within=10)
        proxy.drop_reply_to(b"SET settling = false")
        assert store.settle_many([lease]) == [True]
        assert proxy.dropped == 1, "the reply was not dropped"
        record = store.get("settle:lost")
        assert record is not None and not record.settling


def test_postgres_first_use_waits_for_its_pool_within_connect_timeout(postgres_url: str) -> None:
    """A server that answers every reply 50 ms late (well within connect_timeout), and a store
    whose reconnect_timeout (0.02 s) is shorter than that: the pool's first connection takes
    longer than reconnect_timeout to open, and the first call still succeeds. Under load the
    pool used to be asked for a connection it had not opened yet and gave up after
    reconnect_timeout: StoreError on a healthy server."""
    from benchmarks.chaos.proxy import DelayingProxy

    with open_store(postgres_url) as store:  # the schema first: the test times only the pool
        assert store.get("warm") is None
    parts = urlsplit(postgres_url)
    proxy = DelayingProxy(parts.hostname or "127.0.0.1", parts.port or 5432)
    proxy.delay = 0.05
    try:
        slow = urlunsplit((parts.scheme, f"127.0.0.1:{proxy.port}", parts.path,
                           f"{parts.query}&connect_timeout=5&reconnect_timeout=0.02", ""))
        for _ in range(3):
            with open_store(slow) as store:
                lease = store.claim(f"first:{uuid.uuid4().hex}", owner="w", ttl=30)
                assert lease is not None
    finally:
        proxy.close()


def test_postgres_libpq_options_with_spaces_reach_the_server(postgres_url: str) -> None:
    """libpq's own URL options pass through, spaces included (``options=-c name=value``):
    they were re-encoded with "+" for spaces, which libpq refuses."""
    with open_store(f"{postgres_url}&options=-c%20synchronous_commit%3Doff") as store:
        assert store.claim("opts", owner="w", ttl=10) is not None
        with store._get_connections().connection(5.0) as conn:  # type: ignore[attr-defined]
            assert conn.execute("SHOW synchronous_commit").fetchone() == ("off",)


def test_postgres_claim_resent_after_its_lease_expired_hands_out_one_token(
    pg_proxy: tuple[str, ReplyDroppingProxy], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The claim commits and its reply is lost; the re-send comes after the first send's
    lease expired on the server's clock (a reconnect longer than the ttl; MySQL's chaos full
    run met it with a server restart). The re-send must find its own nonce on the row and
    answer that lease, not take over its own row: one call, one token, one history entry."""
    import random

    url, proxy = pg_proxy
    with open_store(url) as store:
        store.get("warm")  # schema made, connection open
        monkeypatch.setattr(random, "uniform", lambda a, b: 1.0)  # reconnect after 1 s
        proxy.drop_reply_to(b"INSERT INTO")
        lease = store.claim("resent", owner="w", ttl=0.5)
        assert proxy.dropped == 1, "the reply was not dropped"
        assert lease is not None and lease.token == 1, lease
        assert [e.event for e in store.history("resent")] == ["claimed"]
