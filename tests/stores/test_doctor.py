"""``celery leases doctor``: each misconfiguration is named, a sound app passes.

Apps are built in-process and judged with ``lease_celery.doctor.diagnose(app)`` (nothing
connects to the broker; the lease store is really opened); two real ``leases doctor``
subprocess runs check the exit codes (tests/support/doctor_apps/). A network file system cannot be
mounted here: that case is simulated by replacing the /proc/mounts reader, and said so below.
"""

from __future__ import annotations

import builtins
import io
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import redis
from celery import Celery

from lease_celery import LeasedTask
from lease_celery.doctor import Finding, diagnose
from lease_celery.stores import sqlite_diagnosis
from tests.support.docs import rendered_rows
from tests.support.policy_helpers import PYTHON_M, cli_env, parse_json, run_cli
from tests.support.private_redis import DURABLE, private_redis

#: ``celery`` itself; the app is named per run with ``-A``.
CELERY_PROGRAM = [sys.executable, "-m", "celery"]


def make_app(store_url: str, *, time_limit: float | None = 600, **conf: Any) -> Celery:
    """A sound app (every setting agreeing with the leases) with ``conf`` changed."""
    app = Celery("doctor", broker="redis://127.0.0.1:6379/11", set_as_current=False)
    settings: dict[str, Any] = {
        "broker_transport_options": {"visibility_timeout": 3600},
        "task_acks_late": True, "task_reject_on_worker_lost": True,
        "worker_prefetch_multiplier": 1, "task_time_limit": time_limit,
        # Recovered work ahead of new work on either broker: new work at 5 (a later Redis
        # priority list than recovery's 0), RabbitMQ queues ordered by priority up to 10.
        "task_default_priority": 5, "task_queue_max_priority": 10,
        "lease_store_url": store_url, "lease_ttl": 30}
    settings.update(conf)
    app.conf.update(settings)

    @app.task(base=LeasedTask, bind=True, shared=False, lease_key="report:{report_id}")
    def report(self: LeasedTask, report_id: int) -> int:
        return report_id

    return app


def by_code(findings: list[Finding]) -> dict[str, Finding]:
    return {f.code: f for f in findings}


def test_sound_app_has_only_ok_findings(sqlite_url: str) -> None:
    """Broker visibility above the time limit and the ttl, acks_late with reject on worker
    lost, prefetch 1, heartbeat ttl/3, an absolute SQLite path on a local disk: only the two
    ``ok`` findings (and the note on the worker pool)."""
    findings = diagnose(make_app(sqlite_url))
    assert {(f.code, f.severity) for f in findings} == {("delivery.ok", "ok"),
                                                        ("ownership.ok", "ok"),
                                                        ("worker.pool", "ok")}


#: (settings changed from the sound app, finding code, severity, words in its message)
MISCONFIGURATIONS: list[tuple[dict[str, Any], str, str, str]] = [
    ({"broker_transport_options": {"visibility_timeout": 300}},
     "broker.visibility_timeout", "warning", "shorter than the longest task (600s)"),
    ({"broker_transport_options": {"visibility_timeout": 20}, "time_limit": 10},
     "broker.visibility_timeout.ttl", "warning", "shorter than lease_ttl=30s"),
    ({"time_limit": None}, "broker.visibility_timeout.unknown", "warning", "no time limit"),
    ({"task_acks_late": False}, "task.acks_late", "warning", "task_acks_late is off"),
    ({"task_reject_on_worker_lost": False}, "task.reject_on_worker_lost", "error",
     "task_reject_on_worker_lost is off"),
    ({"worker_prefetch_multiplier": 4}, "worker.prefetch_multiplier", "warning",
     "worker_prefetch_multiplier=4"),
    ({"lease_heartbeat_interval": 20}, "lease.heartbeat_interval", "warning",
     "lease_heartbeat_interval=20s is not well below lease_ttl=30s"),
    ({"worker_deduplicate_successful_tasks": True}, "worker.deduplicate_successful_tasks",
     "warning", "only catches redeliveries of tasks that already succeeded"),
    ({"lease_store_url": "sqlite://"}, "store.sqlite_memory", "error", "in memory"),
    ({"lease_store_url": "postgresql://127.0.0.1:1/test?connect_timeout=2"},
     "store.unreachable", "error", "cannot be used"),
    ({"lease_sweep_interval": 0}, "lease.sweeper_off", "warning", "sweeper off"),
    ({"broker_url": "amqp://guest@127.0.0.1//", "time_limit": 3600},
     "broker.consumer_timeout", "warning", "consumer_timeout"),
    ({"task_default_priority": None}, "delivery.recovery_priority", "warning",
     "kombu's Redis transport pops priority 0 first, and new work without a priority goes "
     "there too. Set task_default_priority=5"),
    ({"broker_url": "amqp://guest@127.0.0.1//", "task_queue_max_priority": None},
     "delivery.recovery_priority", "warning",
     "goes to the tail of queue celery behind its whole backlog"),
    ({"broker_url": "amqp://guest@127.0.0.1//", "task_default_priority": 10},
     "delivery.recovery_priority", "warning", "published at a priority as high as recovery's"),
    ({"broker_url": "sqs://", "broker_transport_options": {"visibility_timeout": 300}},
     "broker.visibility_timeout", "warning",
     "shorter than the longest task (600s): sqs delivers it again while it runs"),
    ({"broker_url": "sqs://", "broker_transport_options": {"visibility_timeout": 50000}},
     "broker.visibility_timeout.sqs_ceiling", "error",
     "above SQS's ceiling of 12 h (43200s): SQS refuses to create the queue with it"),
    ({"broker_url": "sqs://", "broker_transport_options": {"visibility_timeout": 43200},
      "time_limit": 50000}, "broker.visibility_timeout.sqs_ceiling", "warning",
     "the longest task (50000s) outlasts SQS's ceiling on visibility (12 h"),
    ({"broker_url": "sqs://", "task_reject_on_worker_lost": False},
     "task.reject_on_worker_lost", "error", "task_reject_on_worker_lost is off"),
    ({"broker_url": "amqp://guest@127.0.0.1//", "lease_extend_visibility": True},
     "broker.visibility_extended", "warning", "amqp has no visibility timeout to extend"),
    ({"lease_extend_visibility": "yes"}, "settings.invalid", "error",
     "lease_extend_visibility (setting lease_extend_visibility) must be True or False, "
     "got 'yes'"),
    ({"lease_recovery_priority": "first"}, "settings.invalid", "error",
     "lease_recovery_priority (setting lease_recovery_priority) must be 'auto', a priority "
     "from 0 to 255 or False, got 'first'"),
]


@pytest.mark.parametrize(("conf", "code", "severity", "words"),
                         [pytest.param(*case, id=case[1]) for case in MISCONFIGURATIONS])
def test_each_misconfiguration_is_flagged(
        sqlite_url: str, conf: dict[str, Any], code: str, severity: str, words: str) -> None:
    """Each misconfiguration yields its finding (code, severity, an explanation naming the
    values), and its promise no longer reports ``ok``; errors sort first."""
    conf = dict(conf)
    time_limit = conf.pop("time_limit", 600)
    findings = diagnose(make_app(sqlite_url, time_limit=time_limit, **conf))
    found = by_code(findings)
    assert code in found, [f.code for f in findings]
    assert found[code].severity == severity
    assert words in found[code].message
    assert f"{found[code].promise}.ok" not in found
    ranks = [{"error": 0, "warning": 1, "ok": 2}[f.severity] for f in findings]
    assert ranks == sorted(ranks)


def test_doctor_notes_recovery_without_a_priority(sqlite_url: str) -> None:
    """``lease_recovery_priority=False``, or a transport without message priorities: an ``ok``
    note that recovered work waits behind the backlog (nothing to set), delivery still ok."""
    for conf in ({"lease_recovery_priority": False, "task_default_priority": None},
                 {"broker_url": "memory://"}):
        found = by_code(diagnose(make_app(sqlite_url, **conf)))
        note = found["delivery.recovery_priority"]
        assert note.severity == "ok" and "waits behind the queue's backlog" in note.message
        assert "delivery.ok" in found


def test_extended_visibility_may_be_shorter_than_a_task(sqlite_url: str) -> None:
    """With ``lease_extend_visibility`` a visibility timeout shorter than the longest task is
    the point (the worker extends it while the lease lives): an ``ok`` note saying how often,
    on Redis and SQS, and delivery stays ok; shorter than the ttl is still flagged."""
    for broker in ("redis://127.0.0.1:6379/11", "sqs://"):
        found = by_code(diagnose(make_app(
            sqlite_url, broker_url=broker, lease_extend_visibility=True,
            broker_transport_options={"visibility_timeout": 60})))
        note = found["broker.visibility_extended"]
        assert note.severity == "ok" and "every 15s" in note.message
        assert "broker.visibility_timeout" not in found and "delivery.ok" in found
    short = by_code(diagnose(make_app(sqlite_url, lease_extend_visibility=True,
                                      broker_transport_options={"visibility_timeout": 20})))
    assert short["broker.visibility_timeout.ttl"].severity == "warning"


def test_short_tasks_may_prefetch(sqlite_url: str) -> None:
    """A prefetch multiplier above 1 is only a concern for long tasks: with a 30 s time limit
    it is not flagged."""
    found = by_code(diagnose(make_app(sqlite_url, time_limit=30, worker_prefetch_multiplier=4)))
    assert "worker.prefetch_multiplier" not in found and "delivery.ok" in found


def test_relative_sqlite_path_is_flagged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``sqlite:///leases.sqlite3`` (relative) depends on the worker's working directory."""
    monkeypatch.chdir(tmp_path)
    found = by_code(diagnose(make_app("sqlite:///leases.sqlite3")))
    assert found["store.sqlite_relative"].severity == "warning"
    assert "'leases.sqlite3' is relative" in found["store.sqlite_relative"].message


def test_sqlite_memory_spelled_as_a_path_is_flagged(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``sqlite:///:memory:`` is in memory too (each process has its own leases): an error."""
    monkeypatch.chdir(tmp_path)
    found = by_code(diagnose(make_app("sqlite:///:memory:")))
    assert found.get("store.sqlite_memory", Finding("", "", "", "")).severity == "error"


def fake_mounts(monkeypatch: pytest.MonkeyPatch, text: str) -> None:
    """SIMULATED: make doctor read ``text`` as /proc/mounts (no NFS can be mounted here)."""
    real_open = builtins.open

    def fake_open(path: Any, *args: Any, **kwargs: Any) -> Any:
        if path == "/proc/mounts":
            return io.StringIO(text)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(sqlite_diagnosis, "open", fake_open, raising=False)


def test_sqlite_store_on_a_network_file_system_is_an_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A SQLite store whose directory is (according to /proc/mounts) an NFS mount is an error.
    Simulated: the real file lives on the local disk; only the mounts table doctor reads says
    nfs4 for its directory."""
    fake_mounts(monkeypatch, "/dev/vda / ext4 rw 0 0\n"
                             f"filer:/export {tmp_path} nfs4 rw,relatime 0 0\n")
    found = by_code(diagnose(make_app(f"sqlite:///{tmp_path}/leases.sqlite3")))
    assert found["store.sqlite_network_fs"].severity == "error"
    assert "network file system (nfs4)" in found["store.sqlite_network_fs"].message


def test_filesystem_type_picks_the_longest_mount_point(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``filesystem_type`` (simulated /proc/mounts): the longest mount point containing the
    path wins; a mount point that is only a string prefix (/mnt/share vs /mnt/shared) does not
    contain it; ``\\040`` in a mount point is a space; no readable mounts table → None."""
    fake_mounts(monkeypatch, "rootfs / ext4 rw 0 0\n"
                             "filer:/a /mnt/share nfs rw 0 0\n"
                             "filer:/b /mnt/shared cifs rw 0 0\n"
                             "filer:/c /mnt/shared/deep 9p rw 0 0\n"
                             "filer:/d /mnt/with\\040space fuse.sshfs rw 0 0\n"
                             "broken-line\n")
    fs = sqlite_diagnosis.filesystem_type
    assert fs("/mnt/shared/x.db") == "cifs"
    assert fs("/mnt/shared") == "cifs"
    assert fs("/mnt/shared/deep/x.db") == "9p"
    assert fs("/mnt/share/x.db") == "nfs"
    assert fs("/mnt/sharedx/x.db") == "ext4"
    assert fs("/mnt/with space/x.db") == "fuse.sshfs"
    assert fs("/var/x.db") == "ext4"

    def unreadable(path: Any, *args: Any, **kwargs: Any) -> Any:
        raise PermissionError(path)

    monkeypatch.setattr(sqlite_diagnosis, "open", unreadable, raising=False)
    assert fs("/var/x.db") is None


def test_doctor_command_exit_codes(sqlite_url: str, tmp_path: Path) -> None:
    """The real ``celery -A … leases doctor``: a sound app exits 0 with only ``ok`` lines; an
    app with an unreachable store (and more) exits 1 and names each problem, in text and in
    ``--json``; ``python -m lease_celery -A … doctor`` agrees."""
    env = cli_env(sqlite_url, {"DOCTOR_STORE": sqlite_url})
    celery = CELERY_PROGRAM

    good = run_cli(["-A", "tests.support.doctor_apps.good", "leases", "doctor"], env=env,
                   cwd=tmp_path, program=celery)
    assert good.returncode == 0, good.stdout + good.stderr
    marks = [line.split()[0] for line in good.stdout.splitlines() if line.startswith("  ")]
    assert marks == ["ok", "ok", "ok"]

    bad = run_cli(["-A", "tests.support.doctor_apps.bad", "leases", "doctor"], env=env,
                  cwd=tmp_path, program=celery)
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "ERROR [store.unreachable]" in bad.stdout
    data = run_cli(["-A", "tests.support.doctor_apps.bad", "leases", "--json", "doctor"], env=env,
                   cwd=tmp_path, program=celery)
    assert data.returncode == 1
    codes = {f["code"]: f["severity"] for f in parse_json(data)}
    assert codes == {"store.unreachable": "error", "broker.visibility_timeout": "warning",
                     "broker.visibility_timeout.ttl": "warning", "task.acks_late": "warning",
                     "worker.prefetch_multiplier": "warning",
                     "worker.deduplicate_successful_tasks": "warning",
                     "lease.heartbeat_interval": "warning", "worker.pool": "ok",
                     "delivery.recovery_priority": "warning"}

    python_m = [*PYTHON_M[:3], "-A", "tests.support.doctor_apps.good"]
    assert run_cli(["doctor"], env=env, cwd=tmp_path, program=python_m).returncode == 0


AMQP = "amqp://guest@127.0.0.1//"


def test_amqp_tasks_without_a_time_limit_meet_consumer_timeout(sqlite_url: str) -> None:
    """On RabbitMQ a task with no time limit may outlive consumer_timeout (the message stays
    unacked while it runs, with acks_late): a warning naming the task, what the broker then
    does, that the server's value is assumed (1800 s, unreadable by a client) and what to set."""
    found = by_code(diagnose(make_app(sqlite_url, time_limit=None, broker_url=AMQP)))
    message = found["broker.consumer_timeout"].message
    assert found["broker.consumer_timeout"].severity == "warning"
    assert "tasks with no time limit: tests.stores.test_doctor.report." in message
    assert "closes the channel of a worker holding one longer than consumer_timeout" in message
    assert "delivers the message again, even while that worker still runs it" in message
    assert "assumes RabbitMQ's default, 1800s" in message
    assert "Set consumer_timeout above the longest task on the server" in message
    assert "or a task time limit below it" in message
    assert "visibility" not in message and "delivery.ok" not in found


def test_amqp_consumer_timeout_names_limits_at_or_above_it(sqlite_url: str) -> None:
    """A time limit of 1800 s or more is named with its value; 600 s is within the default
    consumer_timeout (delivery ok); a task without acks_late holds nothing unacked while it
    runs, so it is not named (its own acks_late finding says why it is a problem)."""
    found = by_code(diagnose(make_app(sqlite_url, time_limit=1800, broker_url=AMQP)))
    assert "a time limit of 1800s or more: tests.stores.test_doctor.report (1800s)" in \
        found["broker.consumer_timeout"].message
    found = by_code(diagnose(make_app(sqlite_url, time_limit=600, broker_url=AMQP)))
    assert "broker.consumer_timeout" not in found and "delivery.ok" in found
    found = by_code(diagnose(make_app(sqlite_url, time_limit=None, broker_url=AMQP,
                                      task_acks_late=False)))
    assert "broker.consumer_timeout" not in found and "task.acks_late" in found


@pytest.mark.parametrize(("broker", "words"), [
    ("redis://127.0.0.1:6379/11", " (and sit unacked towards the visibility timeout)."),
    (AMQP, " (and sit unacked towards RabbitMQ's consumer_timeout)."),
    ("filesystem://", "they wait behind it. Use 1"),
], ids=["redis", "amqp", "filesystem"])
def test_prefetch_message_names_what_the_broker_has(sqlite_url: str, broker: str,
                                                    words: str) -> None:
    """The prefetch warning speaks of a visibility timeout only on brokers that have one: on
    RabbitMQ the reserved messages count towards consumer_timeout, elsewhere towards nothing."""
    found = by_code(diagnose(make_app(sqlite_url, broker_url=broker,
                                      worker_prefetch_multiplier=4)))
    message = found["worker.prefetch_multiplier"].message
    assert words in message
    if not broker.startswith("redis"):
        assert "visibility" not in message


def test_rpc_results_are_explained(sqlite_url: str) -> None:
    """``rpc://`` gets an ``ok`` note: a result goes to the publishing thread's reply queue
    only (AsyncResult elsewhere stays PENDING), re-publishes keep the reply_to, and the lease
    row, not the backend, is what lease_celery reads. The app stays sound (delivery.ok)."""
    found = by_code(diagnose(make_app(sqlite_url, broker_url=AMQP, result_backend="rpc://")))
    note = found["backend.rpc"]
    assert note.severity == "ok" and note.promise == "delivery"
    for words in ("reply queue of the thread that published it (its reply_to)",
                  "AsyncResult(id).get() anywhere else", "stays PENDING",
                  "Redeliveries and lease re-publishes keep the reply_to",
                  "the lease row is the record"):
        assert words in note.message
    assert {f.severity for f in found.values()} == {"ok"}
    assert "delivery.ok" in found
    assert "backend.rpc" not in by_code(diagnose(make_app(sqlite_url)))


#: (redis-server options, finding code or None, severity, words in its message)
EVICTION: list[tuple[tuple[str, ...], str | None, str, str]] = [
    (("--maxmemory", "64mb", "--maxmemory-policy", "allkeys-lru"), "store.redis_eviction",
     "error", "maxmemory-policy='allkeys-lru' with maxmemory=67108864: once full"),
    (("--maxmemory-policy", "allkeys-lfu"), "store.redis_eviction", "warning",
     "nothing is evicted while maxmemory is 0"),
    (("--rename-command", "CONFIG", ""), "store.redis_eviction_unknown", "warning",
     "could not check the Redis lease store's"),
    (("--maxmemory", "64mb", "--maxmemory-policy", "volatile-lru"), None, "", ""),
    (("--maxmemory", "64mb", "--maxmemory-policy", "noeviction"), None, "", ""),
]


@pytest.mark.parametrize(("options", "code", "severity", "words"), EVICTION,
                         ids=["allkeys-lru", "allkeys-lfu-unlimited", "config-disabled",
                              "volatile-lru", "noeviction"])
def test_redis_store_maxmemory_policy(tmp_path: Path, options: tuple[str, ...],
                                      code: str | None, severity: str, words: str) -> None:
    """A Redis store's maxmemory-policy, read with CONFIG GET on a real server of the test's
    own: an allkeys-* policy evicts lease rows and token counters (an error once maxmemory is
    set, a warning while there is no limit); CONFIG renamed away (as managed Redis does) is
    said to be unchecked; noeviction and volatile-* (lease keys never expire) pass."""
    with private_redis(tmp_path, *DURABLE, *options) as url:
        found = by_code(diagnose(make_app(url)))
    eviction = {c: f for c, f in found.items() if c.startswith("store.redis_eviction")}
    if code is None:
        assert not eviction and "ownership.ok" in found
        return
    assert list(eviction) == [code]
    assert eviction[code].severity == severity
    assert words in eviction[code].message
    assert "Set maxmemory-policy noeviction (or volatile-*: lease keys never expire)" in \
        eviction[code].message
    assert "ownership.ok" not in found


def test_shared_test_redis_store_passes_the_eviction_check(redis_store_url: str) -> None:
    """The suite's own Redis (noeviction, Redis's default) passes the eviction check."""
    found = by_code(diagnose(make_app(redis_store_url)))
    assert not [c for c in found if c.startswith("store.redis_eviction")]


#: (redis-server options, severity of store.redis_persistence or None, words in its message)
PERSISTENCE: list[tuple[tuple[str, ...], str | None, str]] = [
    ((), "warning", "appendonly no"),
    (("--appendonly", "yes", "--appendfsync", "everysec"), "warning", "appendfsync everysec"),
    (("--appendonly", "yes", "--appendfsync", "no"), "warning", "appendfsync no"),
    (("--rename-command", "CONFIG", ""), "warning", "could not check"),
    (DURABLE, None, ""),
]


@pytest.mark.parametrize(("options", "severity", "words"), PERSISTENCE,
                         ids=["no-aof", "everysec", "fsync-no", "config-disabled", "always"])
def test_redis_store_persistence(tmp_path: Path, options: tuple[str, ...],
                                 severity: str | None, words: str) -> None:
    """A Redis store that a restart can roll back (no AOF, or an AOF not fsynced on every
    write) is a warning naming what is lost: rows of running leases and receipts vanish, and
    a loss of the latest writes goes unseen by the epoch. appendonly yes with appendfsync
    always passes."""
    with private_redis(tmp_path, *options) as url:
        found = by_code(diagnose(make_app(url)))
    persistence = found.get("store.redis_persistence")
    if severity is None:
        assert persistence is None and "ownership.ok" in found
        return
    assert persistence is not None and persistence.severity == severity, found
    assert words in persistence.message
    if words != "could not check":
        assert "rows of running leases and effect receipts vanish" in persistence.message
        assert "a loss of the latest writes is not" in persistence.message
        assert "appendonly yes" in persistence.message and "appendfsync always" in \
            persistence.message


def test_a_replica_without_min_replicas_to_write_is_named(tmp_path: Path) -> None:
    """A durable primary with a replica attached and min-replicas-to-write 0: a failover may
    lose the writes the replica had not received; the finding says so."""
    (tmp_path / "primary").mkdir()
    (tmp_path / "replica").mkdir()
    with private_redis(tmp_path / "primary", *DURABLE) as url:
        port = urlsplit(url).port
        with private_redis(tmp_path / "replica", "--replicaof", "127.0.0.1", str(port)):
            client = redis.Redis(port=port)
            deadline = time.monotonic() + 10
            while client.info("replication").get("connected_slaves", 0) < 1:
                assert time.monotonic() < deadline, "the replica never connected"
                time.sleep(0.1)
            found = by_code(diagnose(make_app(url)))
    replica = found.get("store.redis_replicas")
    assert replica is not None and replica.severity == "warning", found
    assert "min-replicas-to-write" in replica.message and "failover" in replica.message


def test_doctor_explains_the_grace_to_tasks_that_record_at_publish(sqlite_url: str) -> None:
    """With ``lease_record_at_publish`` on, ``doctor`` adds one ``ok`` note (delivery) that
    names the tasks, the grace and the queue-wait cap, and what a short or long grace costs; a
    wrong type is an error naming the setting; off, no note."""
    assert "delivery.record_at_publish" not in by_code(diagnose(make_app(sqlite_url)))
    found = by_code(diagnose(make_app(sqlite_url, lease_record_at_publish=True,
                                      lease_sweep_grace=30)))
    note = found["delivery.record_at_publish"]
    assert (note.severity, note.promise) == ("ok", "delivery")
    assert "lease_sweep_grace=30s" in note.message and "up to 10 graces (300s)" in note.message
    assert "re-publishes some that were only waiting" in note.message
    assert "delays the recovery of a lost one" in note.message
    assert ".report" in note.message
    bad = [f for f in diagnose(make_app(sqlite_url, lease_record_at_publish="yes"))
           if f.severity == "error"]
    assert any("lease_record_at_publish (setting lease_record_at_publish) must be True or False"
               in f.message for f in bad), bad


def _documented_settings() -> list[tuple[str, str]]:
    """(name, where) of every ``lease_*`` name in the documentation's settings table
    (docs/reference/settings.md, rendered by docs/hooks.py): ``task`` for a task-only option,
    ``app`` for an app-wide setting, ``both`` for the rest."""
    where = {"task option only": "task", "app-wide only": "app", "app, or per task": "both"}
    return [(name, where[scope]) for name, (scope, _) in rendered_rows().items()
            if name.startswith("lease_")]


def test_every_documented_setting_is_one_doctor_knows(sqlite_url: str) -> None:
    """Each ``lease_*`` name of the documentation's settings table, set where it says it
    goes, draws no ``settings.unknown`` or ``settings.app_only`` finding: the table and the
    names doctor knows (lease_celery.names) do not drift apart."""
    documented = _documented_settings()
    assert len(documented) >= 15, documented
    for name, where in documented:
        if where == "task":
            continue  # a task option set in app.conf is flagged by design
        findings = diagnose(make_app(sqlite_url, **{name: _valid_value(name)}))
        problems = [f.message for f in findings
                    if f.code in ("settings.unknown", "settings.app_only")]
        assert problems == [], (name, problems)


def _valid_value(name: str) -> Any:
    return {"lease_store_url": None, "lease_metrics_addr": "127.0.0.1",
            "lease_finish_in_background": "auto", "lease_recovery_priority": "auto"}.get(
        name, True if name in ("lease_record_at_publish", "lease_retry_time_limits") else 1)
