"""A store never misleads about its URL or its server.

Every store (SQLite, PostgreSQL, Redis) refuses a URL option it does not know with a
``ConfigError`` that names the option and lists the known ones, both from ``open_store`` and
from the class's ``check_url`` (what the settings run on a host that only publishes tasks,
without reaching the server). A bad value of a known option is a ``ConfigError`` naming the
option, never the driver's ``TypeError`` or ``ValueError``.

And every public member of the ``Store`` contract, enumerated from the class so that a new
method without a recipe here fails the walk, raises ``StoreError`` with the driver's exception
as ``__cause__`` when the server is gone: nothing listening, a connection cut under an open
store (a proxy of this test's own: the shared servers are never stopped), an SQLite file that
is not a database or whose directory vanished. A driver error never escapes raw.

Only 127.0.0.1 is contacted; a "dead" server is a loopback port nothing listens on.
"""

from __future__ import annotations

import inspect
import re
import shutil
import socket
import sqlite3
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import psycopg
import pytest
import redis

from lease_celery import (
    ConfigError,
    EffectState,
    Lease,
    LeaseState,
    Store,
    StoreError,
    open_store,
)
from lease_celery.limits import GroupLimit
from lease_celery.models import HistoryEntry
from lease_celery.stores.registry import store_class
from tests.support.proxy import cuttable_proxy
from tests.support.servers import PG_DSN, REDIS_HOST, REDIS_PORT, REDIS_STORE_DB

DRIVER_ERRORS: dict[str, type[BaseException]] = {
    "sqlite": sqlite3.Error,
    "postgres": psycopg.Error,
    "redis": redis.RedisError,
}


def _dead_port() -> int:
    """A loopback port with nothing listening: bound, read, closed."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def _server_url(kind: str, query: str, *, port: int | None = None, path: str | None = None
                ) -> str:
    """A PostgreSQL or Redis store URL on 127.0.0.1 (a dead port unless ``port``)."""
    port = port or _dead_port()
    if kind == "postgres":
        return f"postgresql://127.0.0.1:{port}{path or '/test'}?{query}"
    return f"redis://127.0.0.1:{port}{path or f'/{REDIS_STORE_DB}'}?{query}"


def _url(kind: str, query: str, tmp_path: Path) -> str:
    if kind == "sqlite":
        return f"sqlite:///{tmp_path}/leases.sqlite3?{query}"
    return _server_url(kind, query)


def _refused(url: str) -> list[ConfigError]:
    """``open_store(url)`` and ``check_url(url)`` each raise ConfigError (nothing reached):
    return both errors."""
    errors: list[ConfigError] = []
    with pytest.raises(ConfigError) as opened:
        open_store(url).close()
    errors.append(opened.value)
    with pytest.raises(ConfigError) as checked:
        store_class(url).check_url(url)
    errors.append(checked.value)
    return errors


# -- unknown options --------------------------------------------------------------------------

#: kind -> (a misspelled option, the store's own options its error must list)
MISSPELLED = {
    "sqlite": ("busy_timout=2", ["busy_timeout", "synchronous"]),
    "postgres": ("schemaa=x", ["schema", "pool_max", "reconnect_timeout", "connect_timeout",
                               "sslmode", "application_name"]),
    "redis": ("prefx=a:", ["prefix", "socket_timeout", "socket_connect_timeout",
                           "health_check_interval", "client_name"]),
}


@pytest.mark.parametrize("kind", sorted(MISSPELLED))
def test_unknown_option_is_named_with_the_known_ones(kind: str, tmp_path: Path) -> None:
    """A misspelled URL option (redis ``prefx``, postgres ``schemaa``, sqlite ``busy_timout``)
    is a ConfigError from open_store and from check_url, before any server is contacted (the
    server URLs point at a dead port): the message names the option, suggests the one meant,
    and lists the known options. Redis opened such a URL, and its first call raised redis-py's
    ``TypeError: ... unexpected keyword argument 'prefx'``."""
    query, known = MISSPELLED[kind]
    bad = query.split("=")[0]
    for error in _refused(_url(kind, query, tmp_path)):
        message = str(error)
        assert f"unknown {kind} URL option" in message, message
        assert repr(bad) in message, message
        assert "did you mean" in message and repr(known[0]) in message, message
        listed = message.split("known:", 1)[1]
        for name in known:
            assert re.search(rf"\b{name}\b", listed), (name, message)


@pytest.mark.parametrize("kind", sorted(MISSPELLED))
def test_an_option_given_twice_is_refused(kind: str, tmp_path: Path) -> None:
    """An option given twice is a ConfigError naming it: the store and its driver would not
    agree on which one counts (redis-py keeps the first, a dict the last)."""
    option = {"sqlite": "busy_timeout=1&busy_timeout=2", "postgres": "schema=a&schema=b",
              "redis": "prefix=a:&prefix=b:"}[kind]
    for error in _refused(_url(kind, option, tmp_path)):
        assert "given more than once" in str(error) and repr(option.split("=")[0]) in str(error)


def test_redis_options_the_store_does_not_pass_on_are_refused() -> None:
    """redis-py connection options the store sets itself or cannot honour (decode_responses,
    retry_on_timeout, protocol, max_connections) are refused like unknown ones, instead of
    silently changing what the store reads back or how it retries."""
    for option in ("decode_responses=false", "retry_on_timeout=true", "protocol=3",
                   "max_connections=2"):
        for error in _refused(_server_url("redis", option)):
            assert repr(option.split("=")[0]) in str(error), (option, str(error))


def test_redis_tls_options_need_rediss() -> None:
    """``ssl_*`` options on a ``redis://`` URL are a ConfigError saying they need
    ``rediss://`` (redis-py's plain connection raised TypeError at first use); on ``rediss://``
    the same options are accepted by check_url."""
    for error in _refused(_server_url("redis", "ssl_cert_reqs=none")):
        assert "'ssl_cert_reqs'" in str(error) and "rediss://" in str(error), str(error)
    url = _server_url("redis", "ssl_cert_reqs=none&ssl_check_hostname=false&ssl_ca_certs=/x.pem")
    store_class(url).check_url(url.replace("redis://", "rediss://", 1))


# -- bad values of known options ---------------------------------------------------------------

BAD_VALUES = [
    ("sqlite", "busy_timeout=soon", "busy_timeout"),
    ("sqlite", "synchronous=off", "synchronous"),
    ("postgres", "schema=a-b", "schema"),
    ("postgres", "pool_max=0", "pool_max"),
    ("postgres", "reconnect_timeout=later", "reconnect_timeout"),
    ("postgres", "connect_timeout=abc", "connect_timeout"),
    ("postgres", "sslmode=bogus", "sslmode"),
    ("redis", "socket_timeout=abc", "socket_timeout"),
    ("redis", "socket_timeout=-1", "socket_timeout"),
    ("redis", "socket_connect_timeout=0", "socket_connect_timeout"),
    ("redis", "health_check_interval=often", "health_check_interval"),
    ("redis", "health_check_interval=-5", "health_check_interval"),
    ("redis", "socket_keepalive=maybe", "socket_keepalive"),
    ("redis", "client_name=two%20words", "client_name"),
    ("redis", "db=abc", "db"),
]


@pytest.mark.parametrize(("kind", "query", "option"), BAD_VALUES)
def test_bad_value_of_a_known_option_is_named(kind: str, query: str, option: str,
                                              tmp_path: Path) -> None:
    """A known option with a value its store or driver cannot use is a ConfigError naming the
    option, from open_store and check_url alike, never the driver's TypeError/ValueError at
    first use (``socket_timeout=-1`` raised ``ValueError: Timeout value out of range``;
    ``connect_timeout=abc`` passed check_url and failed only when connecting)."""
    for error in _refused(_url(kind, query, tmp_path)):
        assert option in str(error), str(error)


@pytest.mark.parametrize("url", [
    "redis://127.0.0.1:6379/abc",          # redis-py silently used database 0
    "redis://127.0.0.1:notaport/0",         # urllib's ValueError, raw
    "postgresql://127.0.0.1:99999/test",    # urllib's ValueError, raw
])
def test_bad_database_or_port_in_a_server_url_is_named(url: str) -> None:
    """A Redis database that is not a number, or a port that is not one (or out of range),
    is a ConfigError naming the part, never a raw ValueError or a silent database 0."""
    for error in _refused(url):
        assert "database" in str(error) or "port" in str(error), str(error)


def test_every_accepted_option_is_accepted(tmp_path: Path) -> None:
    """The options the stores document pass check_url, and a Redis store opened with all of
    its connection options works against the real server."""
    urls = [
        f"sqlite:///{tmp_path}/x.db?busy_timeout=2.5&synchronous=normal",
        _server_url("postgres", "schema=s1&pool_max=2&reconnect_timeout=1&connect_timeout=2"
                                "&sslmode=disable&application_name=a&options=-c%20x%3Dy"),
        _server_url("redis", "prefix=p:&socket_timeout=1.5&socket_connect_timeout=2"
                             "&health_check_interval=0&client_name=walker&socket_keepalive=true"
                             "&db=13&wait_replicas=1&wait_timeout=0.5"),
    ]
    for url in urls:
        store_class(url).check_url(url)
    live = _server_url("redis", "prefix=lease_test_options:&socket_timeout=2&client_name=opts"
                                "&health_check_interval=1&socket_keepalive=yes",
                       port=REDIS_PORT)
    with open_store(live) as store:
        assert store.get("never-written") is None


# -- every public method against a dead server ------------------------------------------------

LEASE = Lease("walk:1", "walker", 1, 0.0, 1)


def _fenced(store: Store) -> None:
    with store.fenced(LEASE):
        pass


def _reset_epoch(store: Store) -> object:
    """The SQL stores keep no epoch: they say so (ConfigError) without their server."""
    try:
        return store.reset_epoch()
    except ConfigError as exc:
        assert "keeps no epoch" in str(exc)
        return None


#: How the walk calls each public member of the Store contract.
RECIPES: dict[str, Callable[[Store], object]] = {
    "claim": lambda s: s.claim("walk:1", owner="walker", ttl=10),
    "record_published": lambda s: s.record_published("walk:p", task={"task": "t", "args": []}),
    "renew": lambda s: s.renew(LEASE, ttl=10),
    "renew_many": lambda s: s.renew_many([LEASE], ttl=10),
    "finish": lambda s: s.finish(LEASE, {"ok": 1}),
    "finish_and_claim": lambda s: s.finish_and_claim(LEASE, {"ok": 1}, "walk:2",
                                                     owner="walker", ttl=10),
    "settle": lambda s: s.settle(LEASE),
    "settle_many": lambda s: s.settle_many([LEASE]),
    "claim_settlement": lambda s: s.claim_settlement("walk:1", owner="walker", ttl=10),
    "release": lambda s: s.release(LEASE, delay=1.0, reason="walk"),
    "kill": lambda s: s.kill(LEASE, reason="walk"),
    "checkpoint": lambda s: s.checkpoint(LEASE, '{"step": 1}'),
    "cancel": lambda s: s.cancel("walk:1", reason="walk"),
    "record_history_many": lambda s: s.record_history_many(
        [HistoryEntry("walk:1", 1.0, "claimed", "walker", 1, 1)]),
    "record_history": lambda s: s.record_history("walk:1", "operator:walk", detail="walk"),
    "history": lambda s: s.history("walk:1"),
    "history_many": lambda s: s.history_many(["walk:1", "walk:2"]),
    "recent_history": lambda s: s.recent_history(events=["claimed"]),
    "prune_history": lambda s: s.prune_history(60.0),
    "force_release": lambda s: s.force_release("walk:1", reason="walk"),
    "requeue": lambda s: s.requeue("walk:1", reason="walk"),
    "find": lambda s: s.find(state=LeaseState.RUNNING),
    "stats": lambda s: s.stats(),
    "purge_older_than": lambda s: s.purge_older_than(60.0),
    "sweep_unmark": lambda s: s.sweep_unmark("walk:1", 1),
    "sweep_expired": lambda s: s.sweep_expired(),
    "purge": lambda s: s.purge("walk:1"),
    "get": lambda s: s.get("walk:1"),
    "settled_by": lambda s: s.settled_by(LEASE, LeaseState.DONE),
    "fenced": _fenced,
    "effects": lambda s: s.effects.get("walk:effect"),
    "effect_insert": lambda s: s.effect_insert("walk:effect", "fp", LEASE),
    "effect_get": lambda s: s.effect_get("walk:effect"),
    "effect_find": lambda s: s.effect_find(state=EffectState.IN_FLIGHT),
    "effect_update": lambda s: s.effect_update("walk:effect", version=1,
                                               state=EffectState.DONE, result="1"),
    "effect_restart": lambda s: s.effect_restart("walk:effect", version=1, lease=LEASE),
    "effect_delete": lambda s: s.effect_delete("walk:effect", version=1),
    "claim_limited": lambda s: s.claim_limited("walk:l", owner="walker", ttl=10,
                                               limit=GroupLimit("walk", limit=2)),
    "hand_on": lambda s: s.hand_on("walk"),
    "set_limit": lambda s: s.set_limit("walk", concurrency=3),
    "limits": lambda s: s.limits(),
    "limit_group": lambda s: s.limit_group("walk"),
    "now": lambda s: s.now(),
    "epoch": lambda s: s.epoch(),
    "reset_epoch": _reset_epoch,
    "diagnose": lambda s: s.diagnose(),
    "check_url": lambda s: type(s).check_url(s.url),
    "close": lambda s: s.close(),  # last: the others must not depend on it
}

#: Members whose writes go through the app's own connection (its transaction), not the
#: store's: on a dead database the app's driver fails first, with the app's own error, and
#: the walk has no store connection to cut. tests/stores/test_app_transactions.py covers them.
APP_CONNECTION = {"lock_in", "finish_in", "record_published_in"}

#: Members that answer without the server: they must return, not raise.
NO_SERVER: dict[str, set[str]] = {
    # The SQLite clock is the host's; the SQL stores keep no epoch.
    "sqlite": {"now", "check_url", "close", "epoch", "reset_epoch"},
    "postgres": {"check_url", "close", "epoch", "reset_epoch"},
    "redis": {"check_url", "close", "prune_history"},  # Redis caps history instead of pruning
}
#: Members a store does not offer: a StoreError of its own (no driver error behind it).
UNSUPPORTED: dict[str, set[str]] = {"sqlite": set(), "postgres": set(), "redis": {"fenced"}}


def _public_members() -> list[str]:
    """Every public method, classmethod and property of the Store contract."""
    return sorted(name for name, value in inspect.getmembers(Store)
                  if not name.startswith("_")
                  and (callable(value) or isinstance(inspect.getattr_static(Store, name),
                                                     property)))


def test_every_public_member_has_a_recipe() -> None:
    """The walk below covers the whole contract: a public member without a recipe (a new
    method) fails here instead of going untested against a dead server."""
    covered = set(RECIPES) | APP_CONNECTION
    assert set(_public_members()) == covered, (
        f"no recipe: {sorted(set(_public_members()) - covered)}; "
        f"stale recipe: {sorted(covered - set(_public_members()))}")


def _walk(store: Store, kind: str, where: str) -> None:
    """Call every public member; each must raise StoreError naming ``where`` with the driver's
    exception as __cause__ (or answer without the server, as listed). All problems are
    reported together."""
    problems: list[str] = []
    for name in [*sorted(set(_public_members()) - {"close"} - APP_CONNECTION), "close"]:
        recipe = RECIPES.get(name)
        if recipe is None:
            problems.append(f"{name}: no recipe")
            continue
        try:
            recipe(store)
        except StoreError as exc:
            if name in NO_SERVER[kind]:
                problems.append(f"{name}: needs no server, yet raised {exc!r}")
            elif name in UNSUPPORTED[kind]:
                continue
            elif not isinstance(exc.__cause__, DRIVER_ERRORS[kind]):
                problems.append(f"{name}: StoreError without the driver's error as its cause "
                                f"({exc.__cause__!r})")
            elif where not in str(exc):
                problems.append(f"{name}: {str(exc)!r} does not say where ({where})")
        except Exception as exc:  # the failure under test: a raw error escaped
            problems.append(f"{name}: raised {type(exc).__module__}.{type(exc).__qualname__}: "
                            f"{exc}")
        else:
            if name not in NO_SERVER[kind]:
                problems.append(f"{name}: answered without the server")
    assert not problems, "\n".join(problems)


def _walk_url(url: str, kind: str, where: str) -> None:
    """Open ``url`` and walk: opening may itself fail with a StoreError (a store that
    connects eagerly), never with anything else."""
    try:
        store = open_store(url)
    except StoreError as exc:
        assert isinstance(exc.__cause__, DRIVER_ERRORS[kind]), repr(exc.__cause__)
        return
    try:
        _walk(store, kind, where)
    finally:
        store.close()


FAST = {"postgres": "connect_timeout=1&reconnect_timeout=0.02",
        "redis": "socket_connect_timeout=1&socket_timeout=1"}


@pytest.mark.parametrize("kind", ["postgres", "redis"])
def test_every_method_against_nothing_listening(kind: str) -> None:
    """A server URL whose port has nothing listening: every public member raises StoreError
    naming 127.0.0.1:<port>, the driver's error as __cause__."""
    port = _dead_port()
    _walk_url(_server_url(kind, FAST[kind], port=port), kind, f"127.0.0.1:{port}")


@pytest.mark.parametrize("kind", ["postgres", "redis"])
def test_every_method_with_a_misspelled_option_and_a_dead_server(kind: str) -> None:
    """A misspelled option on a dead server: open_store refuses it (ConfigError naming it)
    before any connection. Were it to open anyway, each member would still have to fail with a
    LeaseError, not redis-py's TypeError (which is what Redis did)."""
    port = _dead_port()
    url = _server_url(kind, f"{FAST[kind]}&{MISSPELLED[kind][0]}", port=port)
    try:
        store = open_store(url)
    except ConfigError as exc:
        assert repr(MISSPELLED[kind][0].split("=")[0]) in str(exc)
        return
    try:
        _walk(store, kind, f"127.0.0.1:{port}")
    finally:
        store.close()
    pytest.fail(f"open_store({url!r}) accepted the misspelled option")


@pytest.fixture
def cut_store_url(request: pytest.FixtureRequest) -> Iterator[tuple[str, str, Any]]:
    """(kind, URL through a proxy of this test's own, the proxy) on an isolated schema or
    prefix of the real server."""
    kind: str = request.param
    if kind == "postgres":
        base: str = request.getfixturevalue("postgres_url")
        target = urlsplit(PG_DSN)
        host, port = target.hostname or "127.0.0.1", target.port or 5432
    else:
        base = request.getfixturevalue("redis_store_url")
        host, port = REDIS_HOST, REDIS_PORT
    own = dict(parse_qsl(urlsplit(base).query))  # schema= or prefix=
    with cuttable_proxy(host, port) as proxy:
        path = urlsplit(base).path
        query = "&".join([f"{k}={v}" for k, v in own.items()] + [FAST[kind]])
        yield kind, _server_url(kind, query, port=proxy.port, path=path), proxy


@pytest.mark.parametrize("cut_store_url", ["postgres", "redis"], indirect=True)
def test_every_method_after_the_connection_is_cut(cut_store_url: tuple[str, str, Any]) -> None:
    """A store opened and used through a proxy, which is then cut (every connection dropped,
    new ones refused, as a server that went away): every public member raises StoreError
    naming the proxy's address, the driver's error as __cause__; the store's reconnect and
    re-send give up quickly (connect timeouts of 1 s, reconnect_timeout 0.02 s)."""
    kind, url, proxy = cut_store_url
    with open_store(url) as store:
        lease = store.claim("walk:live", owner="walker", ttl=30)
        assert lease is not None and store.get("walk:live") is not None
        proxy.cut()
        _walk(store, kind, f"127.0.0.1:{proxy.port}")


def test_every_method_on_a_file_that_is_not_a_database(tmp_path: Path) -> None:
    """An SQLite URL naming a file that is not a database: every public member raises
    StoreError naming the file, sqlite3's error as __cause__."""
    path = tmp_path / "notes.txt"
    path.write_bytes(b"these are not the pages you are looking for\n" * 200)
    _walk_url(f"sqlite:///{path}", "sqlite", str(path))


def test_every_method_after_the_directory_vanished(tmp_path: Path) -> None:
    """An SQLite store whose directory is removed after it was opened (before its first
    use): every public member raises StoreError naming the path, sqlite3's error as
    __cause__."""
    directory = tmp_path / "gone"
    directory.mkdir()
    with open_store(f"sqlite:///{directory}/leases.sqlite3") as store:
        shutil.rmtree(directory)
        _walk(store, "sqlite", str(directory))



def test_postgres_on_the_local_socket(postgres_url: str) -> None:
    """``postgresql:///db`` (no host: libpq's local socket) opens and works; a database that
    does not exist there is named with the socket in the message. (The URL used to lose its
    ``//`` on the way to libpq, which refused the whole URL as one keyword.)"""
    schema = dict(parse_qsl(urlsplit(postgres_url).query))["schema"]
    database = urlsplit(PG_DSN).path
    with open_store(f"postgresql://{database}?schema={schema}") as store:
        lease = store.claim("sock:1", owner="w", ttl=30)
        assert lease is not None and store.finish(lease, 1)
        assert store.get("sock:1") is not None
    with pytest.raises(StoreError, match="local socket, database nosuchdb_lease"), \
            open_store("postgresql:///nosuchdb_lease?connect_timeout=2") as store:
        store.get("x")


@pytest.mark.parametrize(("url", "shown"), [
    ("sqlite:////var/lib/app/leases.sqlite3", "sqlite:////var/lib/app/leases.sqlite3"),
    ("sqlite:///leases.sqlite3?synchronous=normal", "sqlite:///leases.sqlite3"),
    ("sqlite://", "sqlite://"),
    ("redis://:pw@h:6379/0?prefix=a", "redis://:***@h:6379/0"),
    ("postgresql://u:pw@db/x?password=p", "postgresql://u:***@db/x"),
])
def test_a_url_shown_in_messages_keeps_its_path_as_written(url: str, shown: str) -> None:
    """``redact`` drops the password and the query, nothing else: an absolute SQLite path
    keeps its four slashes and a relative one its three (not ``sqlite://var/...``, a host,
    nor ``sqlite:/leases...``)."""
    from lease_celery.stores.urls import redact

    assert redact(url) == shown
