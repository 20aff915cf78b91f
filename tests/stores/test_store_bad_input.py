"""Bad input is refused with an error that names the problem, and writes nothing.

Every error is a ``LeaseError``; input errors are also ``ValueError`` (or ``TypeError`` for an
unstorable result), and driver failures come wrapped in ``StoreError`` with the driver's
exception as ``__cause__``. The ttl, key and result checks run on every store (``store_url``:
SQLite, PostgreSQL, Redis); the URL and file checks are SQLite's own. Bad connection input for
the server stores is in ``test_store_servers.py``.
"""

from __future__ import annotations

import inspect
import json
import math
import re
import sqlite3
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path

import psycopg
import pytest
import redis

import lease_celery
from lease_celery import (
    ConfigError,
    InvalidKey,
    Lease,
    LeaseError,
    LeaseState,
    ResultNotSerializable,
    Store,
    StoreError,
    open_store,
)
from lease_celery.stores.mysql import MySQLStore
from lease_celery.stores.postgres import PostgresStore
from lease_celery.stores.redis import RedisStore
from lease_celery.stores.sqlite import SQLiteStore
from lease_celery.testing import ManualClock
from tests.conftest import STORES
from tests.support.servers import PG_DSN, REDIS_STORE_URL


@pytest.fixture
def store(store_url: str, clock: ManualClock) -> Iterator[Store]:
    """A store of each kind (SQLite, PostgreSQL, Redis) on the logical clock."""
    opened = open_store(store_url, clock=clock)
    yield opened
    opened.close()


def _row_count(store: Store) -> int:
    """Lease rows in the store, read past the store (to prove a refused call wrote nothing)."""
    if isinstance(store, SQLiteStore):
        with closing(sqlite3.connect(store.path)) as conn:
            return int(conn.execute("SELECT count(*) FROM lease_celery_leases").fetchone()[0])
    if isinstance(store, PostgresStore):
        with psycopg.connect(PG_DSN) as conn:
            row = conn.execute(
                f'SELECT count(*) FROM "{store.schema}".lease_celery_leases').fetchone()
            assert row is not None
            return int(row[0])
    if isinstance(store, MySQLStore):
        from tests.support.mysql_databases import server_connection

        with closing(server_connection()) as conn, conn.cursor() as cur:
            cur.execute(f"SELECT count(*) FROM `{store.database}`.lease_celery_leases")
            return int(cur.fetchone()[0])
    assert isinstance(store, RedisStore), store
    client = redis.Redis.from_url(REDIS_STORE_URL)
    try:
        return sum(1 for _ in client.scan_iter(f"{store.prefix}lease:*"))
    finally:
        client.close()


# -- URLs -----------------------------------------------------------------------------------


def test_unknown_scheme_is_named() -> None:
    """An unknown URL scheme raises ConfigError naming the scheme and listing known ones."""
    with pytest.raises(ConfigError, match=r"nosuch://.*known schemes: .*postgresql://.*sqlite://"):
        open_store("nosuch://x")


@pytest.mark.parametrize("url", ["", None])
def test_empty_url_is_refused(url: object) -> None:
    """An empty or missing URL raises ConfigError saying the URL must be a non-empty string."""
    with pytest.raises(ConfigError, match=r"URL must be a non-empty string"):
        open_store(url)  # type: ignore[arg-type]


def test_missing_directory_is_named() -> None:
    """A file in a directory that does not exist raises ConfigError naming that directory."""
    with pytest.raises(ConfigError, match=r"directory '/nonexistent-dir-xyz' does not exist"):
        open_store("sqlite:////nonexistent-dir-xyz/leases.db")


def test_directory_as_path_is_refused(tmp_path: Path) -> None:
    """A URL whose path is an existing directory raises ConfigError saying it is a directory."""
    with pytest.raises(ConfigError, match=r"is a directory, not a file"):
        open_store(f"sqlite:///{tmp_path}")


def test_network_location_is_refused() -> None:
    """sqlite://host/path names a host; SQLite files must be local, so it is refused by name."""
    with pytest.raises(ConfigError, match=r"names a host \('host'\)"):
        open_store("sqlite://host/path/leases.db")


@pytest.mark.parametrize("url", ["sqlite:leases.db", "sqlite:/leases.db"])
def test_sqlite_url_without_double_slash_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, url: str
) -> None:
    """A sqlite URL missing the '//' (sqlite:leases.db, sqlite:/leases.db) is refused with a
    ConfigError naming the URL, instead of silently opening some other file (the first
    character of the path must not be dropped); nothing is created in the working directory."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=re.escape(repr(url))):
        store = open_store(url)
        try:
            store.claim("k", owner="w", ttl=10)  # a lazily opened store fails on first use
        finally:
            store.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_unknown_url_option_is_named(tmp_path: Path) -> None:
    """An unknown query option raises ConfigError naming the option and the known ones."""
    with pytest.raises(ConfigError, match=r"unknown sqlite URL option.*'foo'.*known: busy_timeout"):
        open_store(f"sqlite:///{tmp_path}/leases.db?foo=1")


@pytest.mark.parametrize("value", ["abc", "", "nan", "inf", "0", "-1"])
def test_bad_busy_timeout_is_named(tmp_path: Path, value: str) -> None:
    """busy_timeout must be a finite positive number; anything else is a ConfigError naming it."""
    with pytest.raises(ConfigError, match=r"busy_timeout"):
        open_store(f"sqlite:///{tmp_path}/leases.db?busy_timeout={value}")


def test_good_busy_timeout_is_accepted(tmp_path: Path) -> None:
    """A numeric busy_timeout option is accepted and the store works."""
    with open_store(f"sqlite:///{tmp_path}/leases.db?busy_timeout=2.5") as store:
        assert store.claim("k", owner="w", ttl=1) is not None


def test_in_memory_store_works() -> None:
    """SQLite only: sqlite:// (no path) is an in-memory store that supports claim, finish and
    get."""
    with open_store("sqlite://", clock=ManualClock(5)) as store:
        lease = store.claim("report:1", owner="w", ttl=10)
        assert lease == Lease(key="report:1", owner="w", token=1, expires_at=15, fence=lease.fence)
        assert store.claim("report:1", owner="other", ttl=10) is None
        assert store.finish(lease, {"ok": [1, 2]}) is True
        record = store.get("report:1")
        assert (record.state, record.token, record.result) == (LeaseState.DONE, 1, {"ok": [1, 2]})


def test_driver_error_is_wrapped(tmp_path: Path) -> None:
    """SQLite only: a file that is not a SQLite database makes the store raise StoreError (a
    LeaseError) whose __cause__ is the driver's sqlite3.DatabaseError; the file is left as it
    was."""
    path = tmp_path / "garbage.db"
    garbage = b"this is certainly not a SQLite database\x00\xff" * 200
    path.write_bytes(garbage)
    with pytest.raises(StoreError, match=r"not a database") as excinfo:
        store = open_store(f"sqlite:///{path}")  # connection may be opened lazily
        store.claim("k", owner="w", ttl=10)
    assert isinstance(excinfo.value.__cause__, sqlite3.DatabaseError)
    assert path.read_bytes() == garbage


# -- ttl ------------------------------------------------------------------------------------

BAD_TTLS = [0, 0.0, -1, -0.5, math.nan, math.inf, -math.inf, "10", True, False, None]


@pytest.mark.parametrize("ttl", BAD_TTLS, ids=repr)
def test_bad_ttl_on_claim_is_refused_and_writes_nothing(
    store: Store, clock: ManualClock, ttl: object
) -> None:
    """claim() with a ttl that is not a finite positive number of seconds raises ConfigError
    naming ttl, on a new key (no row created) and on a claimable expired key (row unchanged)."""
    with pytest.raises(ConfigError, match=r"\bttl\b"):
        store.claim("fresh", owner="w", ttl=ttl)  # type: ignore[arg-type]
    assert store.get("fresh") is None

    lease = store.claim("expired", owner="w", ttl=10)
    assert lease is not None
    clock.now = 200
    before = store.get("expired")
    with pytest.raises(ConfigError, match=r"\bttl\b"):
        store.claim("expired", owner="other", ttl=ttl)  # type: ignore[arg-type]
    assert store.get("expired") == before


@pytest.mark.parametrize("ttl", BAD_TTLS, ids=repr)
def test_bad_ttl_on_renew_is_refused_and_writes_nothing(store: Store, ttl: object) -> None:
    """renew() (and renew_many()) with a bad ttl raise ConfigError naming ttl; the live lease
    keeps its deadline and can still be renewed with a good ttl."""
    lease = store.claim("k", owner="w", ttl=10)
    assert lease is not None
    before = store.get("k")
    with pytest.raises(ConfigError, match=r"\bttl\b"):
        store.renew(lease, ttl=ttl)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"\bttl\b"):
        store.renew_many([lease], ttl=ttl)  # type: ignore[arg-type]
    assert store.get("k") == before
    assert store.renew(lease, ttl=20) is not None


# -- keys -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "message"),
    [
        ("", r"must not be empty"),
        ("   ", r"must not be empty"),
        ("\t\n", r"must not be empty"),
        (None, r"must be a str, got NoneType"),
        (123, r"must be a str, got int"),
        (b"report:1", r"must be a str, got bytes"),
        ("k" * 513, r"513 characters long; the limit is 512"),
    ],
    ids=["empty", "spaces", "whitespace", "None", "int", "bytes", "513-chars"],
)
def test_bad_key_is_refused(store: Store, key: object, message: str) -> None:
    """A key that is not a non-blank str of at most 512 characters raises InvalidKey (also a
    ValueError and a LeaseError) naming the problem, from claim and get; no row is written."""
    existing = store.claim("existing", owner="w", ttl=10)
    assert existing is not None
    before = store.get("existing")
    with pytest.raises(InvalidKey, match=message) as excinfo:
        store.claim(key, owner="w", ttl=10)  # type: ignore[arg-type]
    assert isinstance(excinfo.value, ValueError)
    assert isinstance(excinfo.value, LeaseError)
    with pytest.raises(InvalidKey, match=message):
        store.get(key)  # type: ignore[arg-type]
    assert _row_count(store) == 1
    assert store.get("existing") == before


def test_512_character_key_is_accepted(store: Store) -> None:
    """A key of exactly 512 characters is accepted by claim, get and finish."""
    key = "k" * 512
    lease = store.claim(key, owner="w", ttl=10)
    assert lease is not None and lease.key == key
    assert store.finish(lease, "ok") is True
    record = store.get(key)
    assert (record.key, record.state, record.result) == (key, LeaseState.DONE, "ok")




def _unstorable_text_cases() -> Iterator[object]:
    for kind in STORES:
        for field in ("key", "owner"):
            for name, text in (("NUL", "report:\x00:1"), ("surrogate", "report:\ud800")):
                yield pytest.param(kind, field, text, id=f"{kind}-{field}-{name}")


@pytest.mark.parametrize(("store_url", "field", "text"), list(_unstorable_text_cases()),
                         indirect=["store_url"])
def test_key_or_owner_with_unusual_characters_is_accepted_or_invalid(
    store: Store, field: str, text: str
) -> None:
    """A key or owner containing a NUL character or a lone surrogate is either accepted (the
    claim returns a Lease and get() shows that key and owner) or refused as invalid input — a
    LeaseError that is also a ValueError (InvalidKey / ConfigError) — with no row written. It
    is never a StoreError, which callers treat as "the store could not answer, try later", and
    never a raw driver or codec error."""
    key, owner = (text, "w") if field == "key" else ("report:1", text)
    store.get("schema-warm-up")  # the refusal may come before the store ever connects
    try:
        lease = store.claim(key, owner=owner, ttl=10)
    except Exception as exc:
        assert isinstance(exc, LeaseError) and isinstance(exc, ValueError), (
            f"{type(exc).__module__}.{type(exc).__name__}: {exc}")
        assert _row_count(store) == 0
        return
    assert lease is not None
    record = store.get(key)
    assert record is not None and (record.key, record.owner) == (key, owner)


# -- results --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("result", "named"),
    [
        (object(), r"\bobject\b"),
        ({1, 2}, r"\bset\b"),
        (float("nan"), r"\bfloat\b"),
        (float("inf"), r"\bfloat\b"),
        ({"nested": {1, 2}}, r"\bset\b"),
    ],
    ids=["object", "set", "nan", "inf", "nested-set"],
)
def test_unserializable_result_is_refused_and_writes_nothing(
    store: Store, result: object, named: str
) -> None:
    """finish() with a result that Celery's JSON cannot carry raises ResultNotSerializable (a
    LeaseError and a TypeError) naming the type; the row is unchanged and still running, and
    the same lease can then finish with a good result. (Bytes, datetimes, UUIDs and Decimals
    are carried, as Celery's JSON result serializer carries them: tests/unit.)"""
    lease = store.claim("k", owner="w", ttl=10)
    assert lease is not None
    before = store.get("k")
    with pytest.raises(ResultNotSerializable, match=r"JSON-serializable") as excinfo:
        store.finish(lease, result)
    assert excinfo.match(named)
    assert isinstance(excinfo.value, TypeError)
    after = store.get("k")
    assert after == before
    assert after.state is LeaseState.RUNNING
    assert store.finish(lease, {"good": [1, "two"]}) is True
    assert store.get("k").result == {"good": [1, "two"]}



_RESULTS = [
    ("plain", {"rows": [1, 2.5, "x", None, True], "nested": {"k": ["v"]}, "big": 2**70}),
    ("NUL", "before\x00after"),
    ("surrogate", {"text": "\ud800"}),
    ("float-1e20", {"score": 1e20}),
]


def _round_trip_cases() -> Iterator[object]:
    for kind in STORES:
        for name, result in _RESULTS:
            yield pytest.param(kind, result, id=f"{kind}-{name}")


@pytest.mark.parametrize(("store_url", "result"), list(_round_trip_cases()),
                         indirect=["store_url"])
def test_accepted_result_round_trips_as_written(store: Store, result: object) -> None:
    """A result that encode_result accepts as strict JSON is stored by finish() (True) and
    comes back from get() as the same JSON (same text when re-encoded, so a float stays a
    float) — or, if a store cannot hold it, finish() raises ResultNotSerializable and writes
    nothing. It is never a StoreError (which would make the task run again, forever)."""
    lease = store.claim("k", owner="w", ttl=10)
    assert lease is not None
    before = store.get("k")
    try:
        accepted = store.finish(lease, result)
    except ResultNotSerializable:
        assert store.get("k") == before
        return
    assert accepted is True
    record = store.get("k")
    assert record is not None and record.state is LeaseState.DONE
    assert json.dumps(record.result, sort_keys=True) == json.dumps(result, sort_keys=True)


# -- the error tree -------------------------------------------------------------------------


def test_every_exported_error_is_a_lease_error() -> None:
    """Every exception class exported by lease_celery derives from LeaseError, so callers can
    catch the whole family with one except clause."""
    exported = [getattr(lease_celery, name) for name in lease_celery.__all__]
    errors = [obj for obj in exported if inspect.isclass(obj) and issubclass(obj, BaseException)]
    assert {cls.__name__ for cls in errors} >= {
        "ConfigError",
        "InvalidKey",
        "ResultNotSerializable",
        "StoreError",
        "StoreBusy",
        "LeaseLost",
        "LeaseHeld",
    }
    for cls in errors:
        assert issubclass(cls, LeaseError), cls
    assert issubclass(ConfigError, ValueError)
    assert issubclass(InvalidKey, ValueError)


def test_sqlite_synchronous_option_is_applied_and_checked(tmp_path: Path) -> None:
    """?synchronous=normal sets SQLite's synchronous pragma (the default stays FULL); any other
    value is a ConfigError naming the option and the accepted values."""
    import sqlite3

    for option, expected in (("", 2), ("?synchronous=normal", 1), ("?synchronous=FULL", 2)):
        with open_store(f"sqlite:///{tmp_path}/sync.db{option}") as store:
            assert store.claim(f"k{option}", owner="w", ttl=10) is not None
            conn = store._connection()  # type: ignore[attr-defined]
            assert isinstance(conn, sqlite3.Connection)
            assert conn.execute("PRAGMA synchronous").fetchone()[0] == expected
    with pytest.raises(ConfigError, match=r"synchronous='off'.*full or normal"):
        open_store(f"sqlite:///{tmp_path}/sync.db?synchronous=off")
