"""``celery leases doctor`` on the mistakes it exists to catch: never a traceback, always a
finding that names the setting or option, where its value came from, and the fix.

Each case here once crashed doctor (a ``ConfigError`` raised while the app bound its tasks) or
passed as "sound" (a misspelled name silently ignored). Apps are judged in-process with
``diagnose(app)``; real ``doctor`` subprocesses check the exit code and that nothing printed
is a traceback, and a real ``celery worker`` logs the name findings once at start.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from lease_celery import LeasedTask
from lease_celery.doctor import Finding, diagnose
from tests.support.policy_helpers import CELERY, PYTHON_M, REPO, cli_env, parse_json, run_cli

#: ``celery`` itself; the app is named per run with ``-A``.
CELERY_PROGRAM = CELERY[:3]


def leased_app(store_url: str, *, task_options: dict[str, Any] | None = None,
               **conf: Any) -> Celery:
    """A sound app (as in test_doctor) with ``conf`` changed and ``task_options`` on its task,
    plus a second, sound LeasedTask that every case must still diagnose."""
    app = Celery("mistakes", broker="redis://127.0.0.1:6379/11", set_as_current=False)
    app.conf.update({
        "broker_transport_options": {"visibility_timeout": 3600},
        "task_acks_late": True, "task_reject_on_worker_lost": True,
        "worker_prefetch_multiplier": 1, "task_time_limit": 600,
        "lease_store_url": store_url, "lease_ttl": 30, **conf})
    options = {"lease_key": "report:{report_id}", **(task_options or {})}

    @app.task(base=LeasedTask, bind=True, shared=False, name="mistakes.report", **options)
    def report(self: LeasedTask, report_id: int) -> int:
        return report_id

    @app.task(base=LeasedTask, bind=True, shared=False, name="mistakes.sound",
              lease_key="sound:{n}")
    def sound(self: LeasedTask, n: int) -> int:
        return n

    return app


def errors_of(findings: list[Finding]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for finding in findings:
        if finding.severity == "error":
            out.setdefault(finding.code, []).append(finding.message)
    return out


#: (settings, task options, finding code, words the message must hold)
CRASHES: list[tuple[dict[str, Any], dict[str, Any], str, list[str]]] = [
    ({"lease_ttl": "30s"}, {}, "settings.invalid",
     ["lease_ttl", "setting lease_ttl", "'30s'", "fix:", "number of seconds"]),
    ({}, {"lease_key": "report:{reprot_id}"}, "settings.invalid",
     ["lease_key", "mistakes.report", "reprot_id", "fix:"]),
    ({"lease_heartbeat_interval": 30}, {}, "settings.invalid",
     ["lease_heartbeat_interval", "setting lease_heartbeat_interval", "not shorter than",
      "fix:"]),
    ({}, {"lease_heartbeat_interval": 45}, "settings.invalid",
     ["lease_heartbeat_interval", "task attribute mistakes.report.lease_heartbeat_interval",
      "fix:"]),
    ({"lease_store_url": "mongodb://127.0.0.1/leases"}, {}, "settings.invalid",
     ["lease_store_url", "setting lease_store_url", "unknown lease store URL scheme", "fix:"]),
    ({"lease_retention": "7d"}, {}, "settings.invalid",
     ["lease_retention", "'7d'", "fix:"]),
    ({"lease_sweep_grace": -1}, {}, "settings.invalid", ["lease_sweep_grace", "fix:"]),
    ({"lease_max_attempts": 0}, {}, "settings.invalid", ["lease_max_attempts", "fix:"]),
]


@pytest.mark.parametrize(("conf", "options", "code", "words"),
                         [pytest.param(*case, id=f"{case[2]}-{i}")
                          for i, case in enumerate(CRASHES)])
def test_a_config_error_is_a_finding_not_a_crash(
        sqlite_url: str, conf: dict[str, Any], options: dict[str, Any], code: str,
        words: list[str]) -> None:
    """A bad value (of a setting or a task option) is an error finding naming the name, where
    the value came from and the fix; the app's other, sound task is still diagnosed."""
    app = leased_app(sqlite_url, task_options=options, **conf)
    findings = diagnose(app)
    messages = errors_of(findings).get(code)
    assert messages, [f.code for f in findings]
    text = " ".join(messages)
    for word in words:
        assert word in text, (word, text)
    assert "ownership.ok" not in {f.code for f in findings}


#: (settings, task options, the name as written, the suggestion)
MISSPELLINGS: list[tuple[dict[str, Any], dict[str, Any], str, str]] = [
    ({"lease_tll": 600}, {}, "lease_tll", "lease_ttl"),
    ({"lease_sweep_intreval": 5}, {}, "lease_sweep_intreval", "lease_sweep_interval"),
    ({}, {"lease_max_attempt": 5}, "lease_max_attempt", "lease_max_attempts"),
    ({}, {"lease_keys": "x:{report_id}"}, "lease_keys", "lease_key"),
]


@pytest.mark.parametrize(("conf", "options", "name", "suggestion"),
                         [pytest.param(*case, id=case[2]) for case in MISSPELLINGS])
def test_an_unknown_name_is_an_error_with_a_suggestion(
        sqlite_url: str, conf: dict[str, Any], options: dict[str, Any], name: str,
        suggestion: str) -> None:
    """A ``lease_*`` setting or task option that lease_celery does not know does nothing (a
    misspelled ``lease_key`` silently keys on the task id): an error naming it, where it was
    set, and the closest known name."""
    findings = diagnose(leased_app(sqlite_url, task_options=options, **conf))
    unknown = errors_of(findings).get("settings.unknown", [])
    text = " ".join(unknown)
    assert name in text, [(f.code, f.message) for f in findings]
    assert f"did you mean {suggestion}?" in text
    where = "task mistakes.report" if options else "app.conf"
    assert where in text
    assert "ownership.ok" not in {f.code for f in findings}


@pytest.mark.parametrize("name", ["lease_sweep_interval", "lease_retention",
                                  "lease_sweep_grace", "lease_metrics_port"])
def test_an_app_only_setting_on_a_task_is_an_error(sqlite_url: str, name: str) -> None:
    """Settings that only the app's configuration is read for do nothing on a task: an error
    that says so and where to set it instead."""
    findings = diagnose(leased_app(sqlite_url, task_options={name: 5}))
    text = " ".join(errors_of(findings).get("settings.app_only", []))
    assert f"task mistakes.report sets {name}" in text, [(f.code, f.message) for f in findings]
    assert f"app.conf.{name}" in text


def test_names_under_a_namespace_are_checked(sqlite_url: str) -> None:
    """``config_from_object(..., namespace="CELERY")``: ``CELERY_LEASE_TTL`` is read, a
    misspelled ``CELERY_LEASE_TLL`` is named with the suggestion in the same spelling, and a
    ``LEASE_TTL`` in capitals on an app without a namespace (never read) is named too."""
    class Config:
        CELERY_BROKER_URL = "redis://127.0.0.1:6379/11"
        CELERY_LEASE_STORE_URL = sqlite_url
        CELERY_LEASE_TTL = 60
        CELERY_LEASE_TLL = 5

    app = Celery("namespaced", set_as_current=False)
    app.config_from_object(Config, namespace="CELERY")

    @app.task(base=LeasedTask, bind=True, shared=False, lease_key="n:{n}")
    def job(self: LeasedTask, n: int) -> int:
        return n

    findings = diagnose(app)
    text = " ".join(errors_of(findings).get("settings.unknown", []))
    assert "CELERY_LEASE_TLL" in text and "did you mean CELERY_LEASE_TTL?" in text, text
    assert text.count("CELERY_LEASE_TTL") == 1, text  # the one read is not flagged

    capitals = leased_app(sqlite_url, LEASE_TTL=60)
    text = " ".join(errors_of(diagnose(capitals)).get("settings.unknown", []))
    assert "app.conf sets LEASE_TTL" in text and "did you mean lease_ttl?" in text, text


def test_a_sound_app_has_no_name_findings(sqlite_url: str) -> None:
    """Every known setting and option, set where it belongs, is not flagged."""
    app = leased_app(
        sqlite_url, lease_heartbeat_interval=5, lease_max_attempts=4, lease_max_takeovers=2,
        lease_backoff_base=1.0, lease_backoff_max=30.0, lease_retry_time_limits=False,
        lease_finish_in_background="auto", lease_sweep_interval=10, lease_sweep_grace=60,
        lease_retention=3600, lease_metrics_addr="127.0.0.1",
        task_options={"lease_ttl": 60, "lease_unique": True, "lease_max_attempts": 2,
                      "lease_store_url": sqlite_url})
    findings = diagnose(app)
    assert not errors_of(findings), errors_of(findings)


def _no_traceback(proc: subprocess.CompletedProcess[str]) -> None:
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr


def test_doctor_command_reports_instead_of_crashing(sqlite_url: str, tmp_path: Path) -> None:
    """The real ``celery -A … leases doctor`` and ``python -m lease_celery -A … doctor`` on an
    app with a bad ttl, a misspelled key field and misspelled names: exit 1, each problem a
    line, no traceback; ``--json`` agrees."""
    module = tmp_path / "mistaken_app.py"
    module.write_text(
        "from celery import Celery\n"
        "from lease_celery import LeasedTask\n"
        "app = Celery('mistaken', broker='redis://127.0.0.1:6379/11', set_as_current=False)\n"
        f"app.conf.update(lease_store_url={sqlite_url!r}, lease_ttl='30s', lease_tll=600,\n"
        "                lease_retention='7d')\n"
        "@app.task(base=LeasedTask, bind=True, shared=False, lease_key='r:{reprot_id}')\n"
        "def report(self, report_id):\n"
        "    return report_id\n"
        "@app.task(base=LeasedTask, bind=True, shared=False, lease_keys='x:{a}',\n"
        "          lease_max_attempt=5)\n"
        "def other(self, a):\n"
        "    return a\n")
    env = cli_env(sqlite_url, {"PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])})
    for program in ([*CELERY_PROGRAM, "-A", "mistaken_app", "leases"],
                    [*PYTHON_M[:3], "-A", "mistaken_app"]):
        text = run_cli(["doctor"], env=env, cwd=tmp_path, program=program)
        _no_traceback(text)
        assert text.returncode == 1, text.stdout + text.stderr
        for words in ("lease_ttl (setting lease_ttl)", "reprot_id", "lease_tll",
                      "did you mean lease_ttl?", "lease_retention", "lease_keys",
                      "did you mean lease_key?", "lease_max_attempt"):
            assert words in text.stdout, (words, text.stdout)
    data = run_cli(["doctor", "--json"], env=env, cwd=tmp_path,
                   program=[*CELERY_PROGRAM, "-A", "mistaken_app", "leases"])
    assert data.returncode == 1
    codes = {f["code"] for f in parse_json(data) if f["severity"] == "error"}
    assert {"settings.invalid", "settings.unknown"} <= codes, codes


def test_doctor_reports_an_app_module_that_does_not_import(tmp_path: Path) -> None:
    """``python -m lease_celery -A mod doctor`` on a module whose task class is refused at
    import (a key naming no parameter): one finding naming the module and the error, exit 1;
    other commands: one line, exit 2."""
    (tmp_path / "broken_app.py").write_text(
        "from celery import Celery\n"
        "from lease_celery import LeasedTask\n"
        "app = Celery('broken', broker='redis://127.0.0.1:6379/11', set_as_current=False)\n"
        "class Report(LeasedTask):\n"
        "    name = 'broken.report'\n"
        "    lease_key = 'r:{nope}'\n"
        "    def run(self, report_id):\n"
        "        return report_id\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
    program = [*PYTHON_M[:3], "-A", "broken_app"]
    doctor = run_cli(["doctor"], env=env, cwd=tmp_path, program=program)
    _no_traceback(doctor)
    assert doctor.returncode == 1, doctor.stdout + doctor.stderr
    assert "app.import" in doctor.stdout and "broken_app" in doctor.stdout
    assert "nope" in doctor.stdout
    listing = run_cli(["list"], env=env, cwd=tmp_path, program=program)
    _no_traceback(listing)
    assert listing.returncode == 2
    assert len(listing.stderr.strip().splitlines()) <= 2, listing.stderr
    assert "broken_app" in listing.stderr and "nope" in listing.stderr


def test_doctor_store_option_checks_that_store(sqlite_url: str, tmp_path: Path) -> None:
    """``doctor --store URL`` judges that store, not the app's (it used to ignore it)."""
    env = cli_env(sqlite_url, {"DOCTOR_STORE": sqlite_url})
    dead = "postgresql://127.0.0.1:1/test?connect_timeout=2"
    for args in (["--store", dead, "doctor"], ["doctor", "--store", dead]):
        proc = run_cli(args, env=env, cwd=tmp_path,
                       program=[*CELERY_PROGRAM, "-A", "tests.support.doctor_apps.good", "leases"])
        assert proc.returncode == 1, proc.stdout + proc.stderr
        assert "ERROR [store.unreachable]" in proc.stdout and "127.0.0.1:1" in proc.stdout


def test_worker_logs_name_findings_once_at_start(tmp_path: Path) -> None:
    """A real ``celery worker`` whose app misspells a setting and a task option logs each
    finding once as it starts (and still starts: the names do nothing, they break nothing)."""
    (tmp_path / "typo_app.py").write_text(
        "from celery import Celery\n"
        "from lease_celery import LeasedTask\n"
        "app = Celery('typo', broker='memory://', set_as_current=False)\n"
        f"app.conf.update(lease_store_url='sqlite:///{tmp_path}/l.sqlite3', lease_tll=600)\n"
        "@app.task(base=LeasedTask, bind=True, lease_keys='x:{a}')\n"
        "def job(self, a):\n"
        "    return a\n")
    log = tmp_path / "worker.log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
    worker = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "typo_app", "worker", "-P", "solo",
         "--without-mingle", "--without-gossip", "-f", str(log), "-l", "INFO"],
        cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            text = log.read_text() if log.exists() else ""
            if "ready." in text:
                break
            time.sleep(0.2)
        else:
            raise AssertionError(f"worker did not start: {text}")
    finally:
        worker.terminate()
        worker.wait(timeout=20)
    text = log.read_text()
    assert text.count("lease_tll") == 1 and "did you mean lease_ttl?" in text, text
    assert text.count("lease_keys") == 1 and "did you mean lease_key?" in text, text


def test_doctor_imports_the_apps_task_modules(sqlite_url: str, tmp_path: Path) -> None:
    """Tasks in a module the app ``include``s are judged (doctor used to see no LeasedTask);
    an included module that does not import is a finding."""
    (tmp_path / "included_tasks.py").write_text(
        "from lease_celery import LeasedTask\n"
        "from included_app import app\n"
        "@app.task(base=LeasedTask, bind=True, lease_keys='x:{a}')\n"
        "def job(self, a):\n"
        "    return a\n")
    (tmp_path / "included_app.py").write_text(
        "from celery import Celery\n"
        "app = Celery('included', broker='redis://127.0.0.1:6379/11', set_as_current=False,\n"
        "             include=['included_tasks', 'nosuch_tasks_module'])\n"
        f"app.conf.lease_store_url = {sqlite_url!r}\n")
    env = cli_env(sqlite_url, {"PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])})
    proc = run_cli(["doctor"], env=env, cwd=tmp_path,
                   program=[*CELERY_PROGRAM, "-A", "included_app", "leases"])
    _no_traceback(proc)
    assert proc.returncode == 1, proc.stdout
    assert "lease_keys" in proc.stdout and "did you mean lease_key?" in proc.stdout
    assert "nosuch_tasks_module" in proc.stdout and "tasks.none" not in proc.stdout


@pytest.mark.parametrize(("conf", "name"), [
    ({"lease_sweep_interval": "5m"}, "lease_sweep_interval"),
    ({"lease_metrics_port": "abc"}, "lease_metrics_port"),
    ({"lease_metrics_port": 70000}, "lease_metrics_port")])
def test_worker_settings_doctor_used_to_pass(sqlite_url: str, conf: dict[str, Any],
                                             name: str) -> None:
    """Values the worker's sweeper and metrics server cannot use (it would have failed inside
    a signal handler, silently) are error findings naming the setting."""
    text = " ".join(errors_of(diagnose(leased_app(sqlite_url, **conf))).get("settings.invalid",
                                                                          []))
    assert name in text and "fix:" in text, text


def test_doctor_never_shows_a_store_password(tmp_path: Path) -> None:
    """A store URL with a password is named without it, in text and in JSON."""
    app = leased_app("postgresql://user:s3cret@127.0.0.1:1/x?connect_timeout=1")
    findings = diagnose(app)
    assert "store.unreachable" in {f.code for f in findings}
    assert all("s3cret" not in f.message for f in findings), findings
    found = diagnose(app, store_url="postgresql://user:s3cret@127.0.0.1:1/x?connect_timeout=1")
    assert all("s3cret" not in f.message for f in found)


def test_worker_logs_doctors_warnings_once_at_start(tmp_path: Path) -> None:
    """A real prefork worker (two pool processes) whose app has a relative SQLite path, a
    lease_ttl above the broker's visibility_timeout and task_acks_late off logs each of
    doctor's warnings for it once as it starts, one line each naming the finding's code:
    not again per pool process, nor per task (three tasks run before it is stopped)."""
    from tests.support.servers import REDIS_URL

    (tmp_path / "startup_app.py").write_text(
        "from celery import Celery\n"
        "from lease_celery import LeasedTask\n"
        f"app = Celery('startup', broker={REDIS_URL!r}, set_as_current=False)\n"
        "app.conf.update(lease_store_url='sqlite:///relative.sqlite3', lease_ttl=120,\n"
        "                task_time_limit=60, broker_transport_options={'visibility_timeout': 90},\n"
        "                worker_prefetch_multiplier=1, task_default_priority=5,\n"
        "                task_default_queue='startup-" + tmp_path.name + "')\n"
        "@app.task(base=LeasedTask, bind=True, lease_key='job:{n}')\n"
        "def job(self, n):\n"
        "    return n\n")
    log = tmp_path / "worker.log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
    worker = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "startup_app", "worker", "-P", "prefork", "-c",
         "2", "--without-mingle", "--without-gossip", "-f", str(log), "-l", "INFO"],
        cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        _wait_for_log(log, "ready.")
        subprocess.run(
            [sys.executable, "-c", "from startup_app import job\n"
             "for n in range(3):\n    job.delay(n)\n"],
            cwd=tmp_path, env=env, check=True, timeout=60)
        _wait_for_log(log, "succeeded", count=3)
    finally:
        worker.terminate()
        worker.wait(timeout=20)
    text = log.read_text()
    for code in ("store.sqlite_relative", "broker.visibility_timeout.ttl", "task.acks_late"):
        lines = [line for line in text.splitlines() if f"[{code}]" in line]
        assert len(lines) == 1, (code, text)
        assert "WARNING" in lines[0] and "lease_celery doctor" in lines[0], lines[0]
    assert "[worker.pool]" not in text, text  # an ok note is not a warning


def _wait_for_log(log: Path, marker: str, *, count: int = 1, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    text = ""
    while time.monotonic() < deadline:
        text = log.read_text() if log.exists() else ""
        if text.count(marker) >= count:
            return
        time.sleep(0.2)
    raise AssertionError(f"{marker!r} x{count} not in the worker's log: {text}")


def test_one_refused_task_brings_no_false_findings(sqlite_url: str) -> None:
    """An app whose only LeasedTask is refused (a typo in its lease_key) gets the error that
    names it, and nothing that is only true because doctor could not make that task: not "no
    task uses base=LeasedTask", and not "these tasks have no time limit" while
    task_time_limit=600 bounds every task."""
    app = Celery("typo", broker="redis://127.0.0.1:6379/11", set_as_current=False)
    app.conf.update({
        "broker_transport_options": {"visibility_timeout": 3600},
        "task_acks_late": True, "task_reject_on_worker_lost": True,
        "worker_prefetch_multiplier": 1, "task_time_limit": 600, "task_default_priority": 5,
        "lease_store_url": sqlite_url})

    @app.task(base=LeasedTask, bind=True, shared=False, name="typo.report",
              lease_key="report:{reportid}")
    def report(self: LeasedTask, report_id: int) -> int:
        return report_id

    found = diagnose(app)
    assert [f.code for f in found if f.severity == "error"] == ["settings.invalid"], found
    assert "reportid" in errors_of(found)["settings.invalid"][0]
    assert [f for f in found if f.severity == "warning"] == [], found
