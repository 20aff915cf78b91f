"""LeasedTask configuration and the gate, run through Celery's own tracer (``Task.apply``).

These use the real SQLite store and the real Celery trace path in-process; the broker-level
behaviour is in test_worker_delivery.py.
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from lease_celery import (
    ConfigError,
    InvalidKey,
    LeaseDead,
    LeaseDone,
    LeasedTask,
    LeaseError,
    LeaseHeld,
    LeaseState,
    open_store,
)
from lease_celery.settings import DEFAULT_STORE_URL, DEFAULT_TTL

REPO = Path(__file__).resolve().parents[2]


def make_app(store_url: str, **conf: Any) -> Celery:
    app = Celery("options", broker="memory://", set_as_current=False)
    app.conf.update(lease_store_url=store_url, **conf)
    return app


def test_settings_read_through_app_conf_with_a_celery_namespace(sqlite_url: str) -> None:
    """``CELERY_LEASE_*`` under ``namespace="CELERY"`` configure the leases."""

    class Config:
        CELERY_BROKER_URL = "memory://"
        CELERY_LEASE_STORE_URL = sqlite_url
        CELERY_LEASE_TTL = 12
        CELERY_LEASE_HEARTBEAT_INTERVAL = 2

    app = Celery("namespaced", set_as_current=False)
    app.config_from_object(Config, namespace="CELERY")

    @app.task(base=LeasedTask, shared=False)
    def job() -> None: ...

    app.finalize()
    assert (job.lease_settings.store_url, job.lease_settings.ttl,
            job.lease_settings.heartbeat_interval) == (sqlite_url, 12.0, 2.0)


def test_defaults_and_task_attributes_override_settings(sqlite_url: str) -> None:
    """Defaults: a SQLite file, ttl 30 s, heartbeat ttl/3; task attributes beat settings."""
    app = Celery("defaults", broker="memory://", set_as_current=False)

    @app.task(base=LeasedTask, shared=False)
    def plain() -> None: ...

    app.conf.lease_ttl = 9

    @app.task(base=LeasedTask, shared=False, lease_ttl=60, lease_store_url=sqlite_url)
    def custom() -> None: ...

    app.finalize()
    assert DEFAULT_STORE_URL.startswith("sqlite:///") and DEFAULT_TTL == 30
    assert (plain.lease_settings.ttl, plain.lease_settings.heartbeat_interval) == (9, 3)
    assert plain.lease_settings.store_url == DEFAULT_STORE_URL
    assert (custom.lease_settings.ttl, custom.lease_settings.store_url) == (60, sqlite_url)
    assert custom.lease_settings.heartbeat_interval == 20


@pytest.mark.parametrize(("conf", "message"), [
    ({"lease_ttl": 0}, r"lease_ttl \(setting lease_ttl\) must be a finite number of seconds > 0"),
    ({"lease_ttl": -5}, r"lease_ttl .* > 0, got -5"),
    ({"lease_ttl": math.nan}, r"lease_ttl .* got nan"),
    ({"lease_ttl": math.inf}, r"lease_ttl .* got inf"),
    ({"lease_ttl": "30"}, r"lease_ttl .* must be a number of seconds, got str"),
    ({"lease_heartbeat_interval": 30}, r"lease_heartbeat_interval .* not shorter than lease_ttl"),
    ({"lease_heartbeat_interval": -1}, r"lease_heartbeat_interval"),
    ({"lease_store_url": "mongodb://x/y"}, r"lease_store_url .* unknown lease store URL scheme"),
    ({"lease_store_url": "sqlite://host/x.db"}, r"lease_store_url .* names a host"),
])
def test_invalid_settings_are_refused_when_the_app_is_finalized(
        conf: dict[str, Any], message: str) -> None:
    """A bad ``lease_*`` setting stops the app at registration, naming the setting."""
    app = Celery("bad", broker="memory://", set_as_current=False)
    app.conf.update(conf)

    @app.task(base=LeasedTask, shared=False)
    def job() -> None: ...

    with pytest.raises(ConfigError, match=message):
        app.finalize()


@pytest.mark.parametrize(("options", "message"), [
    ({"lease_key": "report:{missing}"}, r"names \['missing'\], which are not parameters"),
    ({"lease_key": "report:{}"}, r"named fields"),
    ({"lease_key": "report:{0}"}, r"named fields"),
    ({"lease_key": "report:{report_id"}, r"not a valid format string"),
    ({"lease_key": 42}, r"must be a format string, a callable or None"),
    ({"lease_ttl": 0}, r"lease_ttl of task .* > 0"),
    ({"lease_heartbeat_interval": math.nan}, r"lease_heartbeat_interval of task"),
])
def test_invalid_task_options_are_refused_at_registration(
        options: dict[str, Any], message: str) -> None:
    """Bad task options fail when the task class is made, naming the task and the option."""
    app = Celery("badopts", broker="memory://", set_as_current=False)
    with pytest.raises(ConfigError, match=message):
        @app.task(base=LeasedTask, bind=True, shared=False, **options)
        def report(self: LeasedTask, report_id: int) -> None: ...

        app.finalize()


def test_worker_refuses_to_start_with_an_invalid_setting(tmp_path: Path) -> None:
    """``celery worker`` exits non-zero at start, and its output names the bad setting."""
    env = {"LEASE_TEST_TTL": "0", "LEASE_TEST_BROKER": "memory://", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "tests.support.worker_app", "worker", "-P", "solo"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "lease_ttl (setting lease_ttl) must be a finite number of seconds > 0" in proc.stderr


def test_a_worker_refuses_a_recovery_priority_it_cannot_use(tmp_path: Path) -> None:
    """``lease_recovery_priority`` is read at every recovery: a value it refuses stops the
    worker at start, naming the setting and what it takes, instead of failing each recovery.
    Text from the environment that is a number is one."""
    from lease_celery.settings import recovery_priority_setting

    env = {"LEASE_TEST_STORE": f"sqlite:///{tmp_path / 'leases.sqlite3'}",
           "LEASE_TEST_BROKER": "memory://", "LEASE_TEST_RECOVERY_PRIORITY": "first",
           "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "tests.support.worker_app", "worker", "-P", "solo"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert ("lease_recovery_priority (setting lease_recovery_priority) must be 'auto', a "
            "priority from 0 to 255 or False, got 'first'") in proc.stderr
    app = Celery("recovery", broker="memory://", set_as_current=False)
    for value, read in (("7", 7), (None, "auto"), ("auto", "auto"), (False, None), (255, 255)):
        app.conf.lease_recovery_priority = value
        assert recovery_priority_setting(app) == read
    for bad in (256, -1, True, 2.5):
        app.conf.lease_recovery_priority = bad
        with pytest.raises(ConfigError, match="lease_recovery_priority"):
            recovery_priority_setting(app)


def test_store_directory_is_checked_by_workers_not_publishers(tmp_path: Path) -> None:
    """A publisher host need not have the workers' SQLite directory: the app finalizes and can
    send tasks. A worker refuses to start with a message naming the setting and directory."""
    app = Celery("publisher", broker="memory://", set_as_current=False)
    app.conf.lease_store_url = "sqlite:////no/such/dir/x.db"

    @app.task(base=LeasedTask, shared=False)
    def job() -> None: ...

    app.finalize()
    assert job.lease_settings.store_url == "sqlite:////no/such/dir/x.db"
    env = {"LEASE_TEST_STORE": "sqlite:////no/such/dir/x.db", "LEASE_TEST_BROKER": "memory://",
           "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "tests.support.worker_app", "worker", "-P", "solo"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "lease_store_url sqlite:////no/such/dir/x.db is not usable" in proc.stderr
    assert "'/no/such/dir' does not exist" in proc.stderr


def test_key_resolution_from_arguments_defaults_and_callables(sqlite_url: str) -> None:
    """Format keys bind positional, keyword and default arguments; callables get the args."""
    app = make_app(sqlite_url)

    @app.task(base=LeasedTask, bind=True, shared=False, lease_key="r:{report_id}:{fmt}")
    def report(self: LeasedTask, report_id: int, fmt: str = "pdf") -> str:
        return self.lease.key

    @app.task(base=LeasedTask, bind=True, shared=False,
              lease_key=lambda *a, **kw: f"cb:{a[0]}:{kw.get('x')}")
    def by_callable(self: LeasedTask, n: int, x: int = 0) -> str:
        return self.lease.key

    @app.task(base=LeasedTask, bind=True, shared=False)
    def by_id(self: LeasedTask) -> str:
        return self.lease.key

    assert report.apply(args=(1,)).get() == "r:1:pdf"
    assert report.apply(kwargs={"report_id": 2, "fmt": "csv"}).get() == "r:2:csv"
    assert by_callable.apply(args=(3,), kwargs={"x": 4}).get() == "cb:3:4"
    assert by_id.apply(task_id="my-task-id").get() == "my-task-id"


@pytest.mark.parametrize(("args", "message"), [
    (("",), r"must not be empty"),
    (("x" * 600,), r"600 characters long; the limit is 512"),
])
def test_bad_keys_fail_the_delivery_and_write_nothing(
        sqlite_url: str, args: tuple[Any, ...], message: str) -> None:
    """A key that resolves empty or oversized raises InvalidKey; no row is written."""
    app = make_app(sqlite_url)
    calls = []

    @app.task(base=LeasedTask, bind=True, shared=False, lease_key="{name}")
    def named(self: LeasedTask, name: str) -> None:
        calls.append(name)

    result = named.apply(args=args)
    assert result.state == "FAILURE"
    assert isinstance(result.result, InvalidKey)
    with pytest.raises(InvalidKey, match=message):
        result.get()
    assert calls == []
    assert open_store(sqlite_url).get("x") is None


def test_direct_call_runs_under_a_lease(sqlite_url: str) -> None:
    """Calling the task as a function is still the protected work: it claims and finishes."""
    app = make_app(sqlite_url)

    @app.task(base=LeasedTask, bind=True, shared=False, lease_key="direct:{n}")
    def job(self: LeasedTask, n: int) -> int:
        self.lease.check()
        return self.lease.token

    assert job(5) == 1
    with pytest.raises(LeaseError, match="only available inside a LeasedTask body"):
        _ = job.lease  # nothing left behind on the shared default request
    record = open_store(sqlite_url).get("direct:5")
    assert record is not None and record.state is LeaseState.DONE and record.result == 1


def test_a_direct_call_of_a_finished_key_says_what_happened(sqlite_url: str) -> None:
    """A direct call on a key already done raises ``LeaseDone`` naming the key and its token
    (not a bare ``celery.exceptions.Ignore``), and runs nothing; on a dead key, ``LeaseDead``
    with its reason."""
    app = make_app(sqlite_url)
    runs: list[int] = []

    @app.task(base=LeasedTask, bind=True, shared=False, lease_key="direct:{n}")
    def job(self: LeasedTask, n: int) -> int:
        runs.append(n)
        return n

    assert job(1) == 1
    with pytest.raises(LeaseDone, match=r"lease 'direct:1' is done with token 1: the call did "
                                        r"not run it again"):
        job(1)
    assert runs == [1]
    with open_store(sqlite_url) as store:
        lease = store.claim("direct:2", owner="w", ttl=30)
        assert lease is not None and store.kill(lease, reason="gave up")
    with pytest.raises(LeaseDead, match=r"lease 'direct:2' is dead with token 1 \(gave up\)"):
        job(2)
    assert runs == [1]


def test_done_key_is_answered_and_held_key_raises_when_eager(sqlite_url: str) -> None:
    """An eager run of a finished key does not run the body again: it is answered with the
    accepted result (a dead key with its failure), as a delivery under another task id is,
    and the same task id run again eagerly too (Celery's ``test_chain_in_chain_with_args``
    applies a chain it had sent, with the ids it froze: it used to get None, IGNORED). A live
    holder makes an eager call fail with LeaseHeld, since there is no broker to re-publish
    to."""
    app = make_app(sqlite_url)
    runs = []

    @app.task(base=LeasedTask, bind=True, shared=False, lease_key="once:{n}")
    def job(self: LeasedTask, n: int) -> int:
        runs.append(n)
        return n

    assert job.apply(args=(1,), task_id="first").get() == 1
    again = job.apply(args=(1,))
    assert (again.state, again.get()) == ("SUCCESS", 1)
    assert job.apply(args=(1,), task_id="first").get() == 1
    assert runs == [1]
    with open_store(sqlite_url) as dead_store:
        lease = dead_store.claim("once:3", owner="w", ttl=30)
        assert lease is not None and dead_store.kill(lease, reason="gave up")
    with pytest.raises(LeaseDead, match="gave up"):
        job.apply(args=(3,)).get()
    assert runs == [1]
    store = open_store(sqlite_url)
    assert store.claim("once:2", owner="someone-else", ttl=60) is not None
    with pytest.raises(LeaseHeld, match="held by someone-else"):
        job.apply(args=(2,)).get()
    assert runs == [1]


def test_body_exception_is_retried_under_the_next_token(sqlite_url: str) -> None:
    """With ``lease_retry_errors`` (opt-in: by default an exception fails the task at once, as
    in Celery), an exception from the body releases the key and the policy retries it (eagerly
    here): the second attempt claims token 2 and succeeds; the row counts both attempts."""
    app = make_app(sqlite_url, lease_retry_errors=True)
    attempts = []

    @app.task(base=LeasedTask, bind=True, shared=False, lease_key="fail:{n}")
    def job(self: LeasedTask, n: int) -> int:
        attempts.append(self.lease.token)
        if len(attempts) == 1:
            raise RuntimeError("first attempt fails")
        return self.lease.token

    assert job.apply(args=(1,)).get() == 2
    assert attempts == [1, 2]
    record = open_store(sqlite_url).get("fail:1")
    assert record is not None and (record.state, record.token, record.attempts) == (
        LeaseState.DONE, 2, 2)


def test_exhausted_attempts_and_permanent_errors_go_dead(sqlite_url: str) -> None:
    """With ``lease_retry_errors`` (the opt-in error retries), a transient error is tried
    lease_max_attempts times, then the key is dead with the reason; a permanent error goes
    dead on the first attempt. Later deliveries are ignored."""
    app = make_app(sqlite_url, lease_max_attempts=3, lease_retry_errors=True)
    calls: list[str] = []

    @app.task(base=LeasedTask, bind=True, shared=False, lease_key="always:{n}",
              permanent_errors=(KeyError,))
    def job(self: LeasedTask, n: int, error: str) -> None:
        calls.append(error)
        raise {"transient": RuntimeError, "permanent": KeyError}[error](f"boom {n}")

    failed = job.apply(args=(1, "transient"))
    assert failed.state == "FAILURE" and isinstance(failed.result, RuntimeError)
    record = open_store(sqlite_url).get("always:1")
    assert record is not None and (record.state, record.attempts) == (LeaseState.DEAD, 3)
    assert "3 attempts exhausted" in (record.reason or "")
    assert calls == ["transient"] * 3

    calls.clear()
    assert job.apply(args=(2, "permanent")).state == "FAILURE"
    record = open_store(sqlite_url).get("always:2")
    assert record is not None and (record.state, record.attempts) == (LeaseState.DEAD, 1)
    assert (record.reason or "").startswith("permanent error: KeyError")
    assert calls == ["permanent"]
    # Dead is terminal: an eager run again is answered with the failure, and runs nothing.
    again = job.apply(args=(2, "permanent"))
    assert again.state == "FAILURE" and isinstance(again.result, LeaseDead)
    assert calls == ["permanent"]


@pytest.mark.parametrize(("conf", "message"), [
    ({"lease_max_attempts": 0}, r"lease_max_attempts \(setting lease_max_attempts\) must be"),
    ({"lease_max_takeovers": 1.5}, r"lease_max_takeovers .* whole number"),
    ({"lease_backoff_base": -1}, r"lease_backoff_base"),
    ({"lease_backoff_base": 10, "lease_backoff_max": 5}, r"lease_backoff_max .* is below"),
])
def test_invalid_policy_settings_are_refused(conf: dict[str, Any], message: str) -> None:
    """Bad failure-policy settings stop the app at registration, naming the setting."""
    app = Celery("badpolicy", broker="memory://", set_as_current=False)
    app.conf.update(conf)

    @app.task(base=LeasedTask, shared=False)
    def job() -> None: ...

    with pytest.raises(ConfigError, match=message):
        app.finalize()


def test_direct_calls_from_threads_each_hold_their_own_lease(sqlite_url: str) -> None:
    """Two threads calling the task directly at once each see their own ``self.lease`` for
    the whole body (Celery's default request is shared; each call gets a request of its own)."""
    import threading

    app = make_app(sqlite_url)
    both_in = threading.Barrier(2)
    seen: dict[str, tuple[str, str]] = {}

    @app.task(base=LeasedTask, bind=True, shared=False, lease_key="doc:{n}")
    def job(self: LeasedTask, n: str) -> str:
        first = self.lease.key
        both_in.wait(5)
        seen[n] = (first, self.lease.key)
        return self.lease.key

    threads = [threading.Thread(target=job, args=(n,)) for n in ("1", "2")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert seen == {"1": ("doc:1", "doc:1"), "2": ("doc:2", "doc:2")}


def test_an_exit_is_never_turned_into_ignore(sqlite_url: str) -> None:
    """A SystemExit (a terminated task) raised after the lease was taken over still exits:
    it is not swallowed as a stale outcome."""
    app = make_app(sqlite_url, lease_ttl=5)
    store = open_store(sqlite_url)

    @app.task(base=LeasedTask, bind=True, shared=False, lease_key="exit:{n}")
    def job(self: LeasedTask, n: int) -> None:
        assert store.force_release(self.lease.key, reason="operator")
        assert store.claim(self.lease.key, owner="someone-else", ttl=30) is not None
        raise SystemExit(-241)

    with pytest.raises(SystemExit):
        job(1)


def test_a_result_celery_stores_as_a_tuple_is_kept_by_the_lease_store(sqlite_url: str) -> None:
    """A task that returns a ``GroupResult`` (Celery's ``test_groupresult_serialization``):
    Celery's backend stores it as its tuple form, and so does the lease row, instead of
    failing the task with ResultNotSerializable. A duplicate is answered with that form,
    which ``result_from_tuple`` reads back as Celery's client does."""
    from celery.result import AsyncResult, GroupResult, result_from_tuple

    app = make_app(sqlite_url, result_backend="cache+memory://")

    @app.task(base=LeasedTask, bind=True, shared=False, lease_key="group:{n}")
    def job(self: LeasedTask, n: int) -> GroupResult:
        return GroupResult(f"group-{n}", [AsyncResult(f"child-{n}", app=app)], app=app)

    result = job.apply(args=(1,))
    assert result.state == "SUCCESS", result.result
    record = open_store(sqlite_url).get("group:1")
    assert record is not None and record.state is LeaseState.DONE
    restored = result_from_tuple(record.result, app=app)
    assert restored.id == "group-1" and [child.id for child in restored] == ["child-1"]


def test_a_result_celerys_json_carries_is_kept_by_the_lease_store(sqlite_url: str) -> None:
    """A task that returns what Celery's own JSON serializer carries (a datetime, a UUID, a
    Decimal, bytes) succeeds, as in Celery, and the row gives the same values back (it was
    ResultNotSerializable: the lease store took strict JSON only)."""
    import datetime
    import decimal
    import uuid as uuid_module

    value = {"at": datetime.datetime(2026, 12, 6, 12, 30, tzinfo=datetime.timezone.utc),
             "id": uuid_module.UUID("12345678-1234-5678-1234-567812345678"),
             "amount": decimal.Decimal("12.50"), "blob": b"\x00\x01"}
    app = make_app(sqlite_url)

    @app.task(base=LeasedTask, bind=True, shared=False, lease_key="typed:{n}")
    def job(self: LeasedTask, n: int) -> dict[str, Any]:
        return value

    result = job.apply(args=(1,))
    assert result.state == "SUCCESS", result.result
    record = open_store(sqlite_url).get("typed:1")
    assert record is not None and record.state is LeaseState.DONE
    assert record.result["at"] == value["at"] and record.result["id"] == value["id"]
    assert str(record.result["amount"]) == "12.50"
    assert job.apply(args=(1,)).get()["at"] == value["at"]  # answered from the row
