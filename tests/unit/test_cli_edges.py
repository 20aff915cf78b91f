"""The ``celery leases`` commands on the inputs a new user meets: no app named, an app that
does not import, options after the sub-command, a publish that fails, awkward keys.

Each case once misled: an empty table (and a new SQLite file) for an app never named, a
re-publish onto Celery's default broker, a traceback, a success line after a failure. The real
programs run in subprocesses; the walk over every command runs Celery's own ``celery`` group
in process (``CliRunner``), which fills in its default app exactly as the program does.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from subprocess import CompletedProcess

import pytest
from celery.bin.celery import celery as celery_program
from click.testing import CliRunner

from lease_celery import LeaseState, Store, open_store
from lease_celery.cli import leases
from tests.support.policy_helpers import CELERY, PYTHON_M, REPO, cli_env, parse_json, run_cli

Cli = Callable[..., CompletedProcess[str]]

#: Arguments that make each command do its work if it were allowed to.
COMMANDS: dict[str, list[str]] = {
    "list": [], "show": ["k"], "history": ["k"], "release": ["k"], "cancel": ["k"],
    "requeue": ["k"], "purge": ["--older-than", "1d"], "stats": [], "sweep": [],
    "doctor": [], "web": ["--port", "0"], "reset-epoch": ["--accept-data-loss"],
    "limits": [], "limit": ["g", "--limit", "2"], "effects": ["discard", "k"],
}


def test_every_command_is_in_the_walk() -> None:
    """The walk below covers every command the group has (a new one must be added)."""
    assert set(leases.commands) == set(COMMANDS)


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_no_app_no_action(command: str, tmp_path: Path, sqlite_url: str,
                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Without ``-A`` Celery hands the command its default app: every command refuses with
    one line naming ``-A APP`` and exit 2, before it opens a store or publishes anything (no
    ``lease_celery.sqlite3`` appears), with or without ``--store``."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("APP", raising=False)
    for args in (["leases", command, *COMMANDS[command]],
                 ["leases", "--store", sqlite_url, command, *COMMANDS[command]]):
        result = CliRunner().invoke(celery_program, args)
        assert result.exit_code == 2, (args, result.output)
        lines = result.output.strip().splitlines()
        assert len(lines) == 1 and "-A APP" in lines[0], result.output
        assert list(tmp_path.iterdir()) == [], list(tmp_path.iterdir())
    helped = CliRunner().invoke(celery_program, ["leases", command, "--help"])
    assert helped.exit_code == 0 and "Usage:" in helped.output, helped.output


def test_no_app_in_the_real_program(tmp_path: Path, sqlite_url: str) -> None:
    """The real ``celery leases list`` and ``celery leases --store URL sweep``, no ``-A``: exit
    2, one line, no file made, nothing published; ``python -m lease_celery`` alike."""
    env = {k: v for k, v in os.environ.items() if k != "APP"}
    env["PYTHONPATH"] = str(REPO)
    for program, args in (([*CELERY[:3], "leases"], ["list"]),
                          ([*CELERY[:3], "leases"], ["--store", sqlite_url, "sweep"]),
                          (PYTHON_M[:3], ["list"]), (PYTHON_M[:3], ["--store", sqlite_url,
                                                                    "stats"])):
        proc = run_cli(args, env=env, cwd=tmp_path, program=program)
        assert proc.returncode == 2, (args, proc.stdout, proc.stderr)
        assert len(proc.stderr.strip().splitlines()) == 1 and "-A APP" in proc.stderr
        assert list(tmp_path.iterdir()) == []


def test_python_m_help_lists_the_commands_and_a_missing_module_is_one_line(
        tmp_path: Path) -> None:
    """``python -m lease_celery --help`` lists every command; ``-A nosuchmod`` is one line
    naming the module, exit 2, as ``celery -A`` says it."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    shown = run_cli(["--help"], env=env, cwd=tmp_path, program=PYTHON_M[:3])
    assert shown.returncode == 0, shown.stderr
    for command in COMMANDS:
        assert f"\n  {command} " in shown.stdout, (command, shown.stdout)
    missing = run_cli(["-A", "nosuchmod", "list"], env=env, cwd=tmp_path,
                      program=PYTHON_M[:3])
    assert missing.returncode == 2
    assert missing.stderr.strip().splitlines() == [
        "Error: Unable to load celery application. The module nosuchmod was not found."]


@pytest.fixture
def store(sqlite_url: str) -> Store:
    with open_store(sqlite_url) as opened:
        return opened


@pytest.fixture
def cli(sqlite_url: str, tmp_path: Path) -> Cli:
    env = cli_env(sqlite_url)

    def run(*args: str, program: list[str] = CELERY) -> CompletedProcess[str]:
        return run_cli(list(args), env=env, cwd=tmp_path, program=program)

    return run


def test_options_after_the_sub_command(sqlite_url: str, cli: Cli, tmp_path: Path) -> None:
    """``show KEY --json``, ``stats --json`` and ``list --store URL`` take the group's options
    after the command too; one given after the command wins."""
    with open_store(sqlite_url) as store:
        lease = store.claim("opt:1", owner="w", ttl=600)
        assert lease is not None and store.finish(lease, {"ok": 1})
    shown = cli("show", "opt:1", "--json")
    assert shown.returncode == 0, shown.stderr
    assert parse_json(shown)["state"] == "done"
    assert parse_json(cli("stats", "--json"))["total"] == 1
    other = f"sqlite:///{tmp_path}/other.sqlite3"
    assert parse_json(cli("--json", "list", "--store", other)) == []
    assert parse_json(cli("stats", "--store", other, "--json"))["total"] == 0


def test_stats_json_names_every_state(sqlite_url: str, cli: Cli) -> None:
    """``stats --json`` counts every state, with 0 for a state that has no rows."""
    with open_store(sqlite_url) as store:
        assert store.claim("s:1", owner="w", ttl=600) is not None
    counts = parse_json(cli("--json", "stats"))["counts"]
    assert counts == {state.value: (1 if state is LeaseState.RUNNING else 0)
                      for state in LeaseState}


def test_control_characters_are_escaped(sqlite_url: str, cli: Cli) -> None:
    """A key or owner with a newline, a tab or a terminal escape prints on one line, escaped,
    in ``list``, ``show`` and ``history``; ``--json`` keeps the exact text."""
    key, owner = "evil\nkey\t\x1b[31m", "own\rer"
    with open_store(sqlite_url) as store:
        assert store.claim(key, owner=owner, ttl=600) is not None
    table = cli("list")
    assert table.returncode == 0, table.stderr
    assert len(table.stdout.splitlines()) == 2, table.stdout
    assert "\x1b" not in table.stdout and "\r" not in table.stdout
    assert r"evil\nkey\t\x1b[31m" in table.stdout and r"own\rer" in table.stdout
    shown = cli("show", key)
    assert shown.returncode == 0, shown.stderr
    assert "\x1b" not in shown.stdout and r"evil\nkey\t\x1b[31m" in shown.stdout
    history = cli("history", key)
    assert "\x1b" not in history.stdout and "\r" not in history.stdout
    assert [r["key"] for r in parse_json(cli("--json", "list"))] == [key]


def test_requeue_names_the_current_state(sqlite_url: str, cli: Cli) -> None:
    """``requeue`` on a key that is not dead says what it is: running with a cancel pending
    (requeue once the holder stopped), done, missing."""
    with open_store(sqlite_url) as store:
        assert store.claim("rq:run", owner="w", ttl=600) is not None
        assert store.cancel("rq:run", reason="stop it")
        done = store.claim("rq:done", owner="w", ttl=600)
        assert done is not None and store.finish(done, 1)
    pending = cli("requeue", "rq:run")
    assert pending.returncode == 1
    assert "is running" in pending.stderr and "cancel pending" in pending.stderr, pending.stderr
    finished = cli("requeue", "rq:done")
    assert finished.returncode == 1 and "is done" in finished.stderr, finished.stderr
    missing = cli("requeue", "rq:none")
    assert missing.returncode == 1 and "no lease for key 'rq:none'" in missing.stderr


def test_sweep_counts_a_failed_publish_as_a_failure(sqlite_url: str, tmp_path: Path) -> None:
    """A re-publish the broker refuses (its port closed) is not counted as re-published:
    the command names the key and why, says the next sweep tries again, prints no traceback
    and exits 1; ``--json`` lists it under ``failed``."""
    (tmp_path / "closed_broker_app.py").write_text(
        "from celery import Celery\n"
        "from lease_celery import LeasedTask\n"
        "app = Celery('closed', broker='redis://127.0.0.1:1/0', set_as_current=False)\n"
        f"app.conf.update(lease_store_url={sqlite_url!r}, broker_connection_timeout=1,\n"
        "                task_publish_retry=False,\n"
        # kombu's own connect retries (2 s) are not what is tested: off.
        "                broker_transport_options={'max_retries': 0})\n"
        "@app.task(base=LeasedTask, bind=True, lease_key='job:{name}')\n"
        "def work(self, name):\n"
        "    return name\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
    program = [sys.executable, "-m", "celery", "-A", "closed_broker_app", "leases"]
    task = {"task": "closed_broker_app.work", "args": ["x"], "kwargs": {},
            "options": {"task_id": "sweep-fail-1"}}
    with open_store(sqlite_url) as store:
        assert store.claim("job:x", owner="dead", ttl=0.05, task=task) is not None
    time.sleep(0.2)
    proc = run_cli(["sweep"], env=env, cwd=tmp_path, program=program)
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    assert "re-published 0 task(s)" in proc.stdout
    assert "job:x" in proc.stderr and "next sweep" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    data = run_cli(["--json", "sweep"], env=env, cwd=tmp_path, program=program)
    assert data.returncode == 1
    assert parse_json(data) == {"swept": [], "failed": ["job:x"], "no_task": [], "handed_on": []}


def test_a_bad_app_setting_is_one_line(sqlite_url: str, tmp_path: Path) -> None:
    """A store command on an app whose ``lease_store_url`` is unusable: one line naming the
    setting, exit 2, never a traceback."""
    module = tmp_path / "bad_url_app.py"
    module.write_text(
        "from celery import Celery\n"
        "app = Celery('bad_url', broker='memory://', set_as_current=False)\n"
        "app.conf.lease_store_url = 'mongodb://127.0.0.1/x'\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
    proc = run_cli(["list"], env=env, cwd=tmp_path,
                   program=[sys.executable, "-m", "celery", "-A", "bad_url_app", "leases"])
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "lease_store_url" in proc.stderr and "mongodb" in proc.stderr


def _app_module(tmp_path: Path, name: str, body: str) -> dict[str, str]:
    """Write ``tmp_path/name.py`` (an app module) and return the environment that imports it."""
    (tmp_path / f"{name}.py").write_text(
        "from celery import Celery\nfrom lease_celery import LeasedTask\n" + body)
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}


def test_requeue_whose_publish_fails_is_one_line(sqlite_url: str, tmp_path: Path) -> None:
    """``requeue`` on a broker that refuses (its port closed): one line saying the row is ready
    again and the sweeper re-publishes it, exit 1, no traceback."""
    env = _app_module(tmp_path, "requeue_closed", (
        "app = Celery('rq', broker='redis://127.0.0.1:1/0', set_as_current=False)\n"
        f"app.conf.update(lease_store_url={sqlite_url!r}, broker_connection_timeout=1,\n"
        "                task_publish_retry=False,\n"
        # kombu's own connect retries (2 s) are not what is tested: off.
        "                broker_transport_options={'max_retries': 0})\n"))
    task = {"task": "requeue_closed.work", "args": [], "kwargs": {},
            "options": {"task_id": "rq-1"}}
    with open_store(sqlite_url) as store:
        lease = store.claim("rq:dead", owner="w", ttl=600, task=task)
        assert lease is not None and store.kill(lease, reason="given up")
    proc = run_cli(["requeue", "rq:dead"], env=env, cwd=tmp_path,
                   program=[sys.executable, "-m", "celery", "-A", "requeue_closed", "leases"])
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "ready again" in proc.stderr and "could not be re-published" in proc.stderr


def test_an_app_whose_configuration_does_not_load_is_one_line(tmp_path: Path) -> None:
    """``config_from_object`` of a module that does not exist fails when Celery first reads
    the configuration: a store command says so in one line (exit 2), doctor as a finding."""
    env = _app_module(tmp_path, "badconf_app", (
        "app = Celery('badconf', set_as_current=False)\n"
        "app.config_from_object('nosuch_config_module')\n"))
    for command, code in (("list", 2), ("doctor", 1)):
        proc = run_cli([command], env=env, cwd=tmp_path,
                       program=[sys.executable, "-m", "celery", "-A", "badconf_app", "leases"])
        assert proc.returncode == code, (command, proc.stdout, proc.stderr)
        assert "Traceback" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
        assert "nosuch_config_module" in proc.stdout + proc.stderr


def test_an_app_set_as_default_is_an_app(sqlite_url: str, tmp_path: Path) -> None:
    """An app that calls ``set_default()`` is still the app ``-A`` named."""
    env = _app_module(tmp_path, "defaulted_app", (
        "app = Celery('defaulted', broker='memory://')\n"
        f"app.conf.lease_store_url = {sqlite_url!r}\n"
        "app.set_default()\n"))
    for program in ([sys.executable, "-m", "celery", "-A", "defaulted_app", "leases"],
                    [sys.executable, "-m", "lease_celery", "-A", "defaulted_app"]):
        proc = run_cli(["--json", "stats"], env=env, cwd=tmp_path, program=program)
        assert proc.returncode == 0, (program, proc.stderr)


def test_operator_commands_escape_keys_and_reasons(sqlite_url: str, cli: Cli) -> None:
    """``release``, ``cancel`` and ``requeue`` print keys and reasons with their control and
    format characters escaped (a terminal title, a bidi override, a newline)."""
    key = "op\n\x1b]0;title\x07\u202ekey"
    shown = r"op\n\x1b]0;title\x07\u202ekey"
    with open_store(sqlite_url) as store:
        assert store.claim(key, owner="w", ttl=600) is not None
    released = cli("release", key, "--reason", "why\x1b[31m")
    assert released.returncode == 0, released.stderr
    assert shown in released.stdout and "\x1b" not in released.stdout
    with open_store(sqlite_url) as store:
        assert store.claim(key, owner="w", ttl=600) is not None
    cancelled = cli("cancel", key, "--reason", "stop\nnow\u202e")
    assert cancelled.returncode == 0, cancelled.stderr
    out = cancelled.stdout
    assert shown in out and "\x1b" not in out and "\u202e" not in out
    assert len(out.strip().splitlines()) == 1, out
    pending = cli("requeue", key)
    assert pending.returncode == 1
    assert "\u202e" not in pending.stderr and "\x1b" not in pending.stderr
    assert len(pending.stderr.strip().splitlines()) == 1, pending.stderr


@pytest.mark.parametrize("url", ["postgresql://[::1/x", "redis://[::1/0", "sqlite://[x/y",
                                 "sqlite:////tmp/pct%00x.sqlite3", ""])
def test_a_malformed_store_url_is_one_line(url: str, cli: Cli) -> None:
    """A ``--store`` URL that is no URL at all (a broken IPv6 host, a NUL byte, empty): one
    line naming it, exit 2."""
    proc = cli("list", "--store", url)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


@pytest.mark.parametrize(("args", "message"), [
    (["--limit", "0"], "--limit must be a whole number >= 1"),
    (["--limit", "-3"], "--limit must be a whole number >= 1"),
    (["--limit", "2.5"], "--limit must be a whole number >= 1"),
    (["--rate", "ten"], "--rate must be a rate such as '10/s'"),
    ([], "give --limit N, --rate R or --reset"),
])
def test_leases_limit_refuses_bad_input_naming_the_option(
        args: list[str], message: str, sqlite_url: str) -> None:
    """``leases limit`` with a bad value: one line naming the option, exit 2, nothing written
    (the group is not listed after)."""
    base = ["-A", "tests.support.worker_app", "leases", "--store", sqlite_url]
    result = CliRunner().invoke(celery_program, [*base, "limit", "tenant:1", *args])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.output
    listed = CliRunner().invoke(celery_program, [*base, "limits", "--json"])
    assert listed.exit_code == 0 and json.loads(listed.output) == [], listed.output
    done = CliRunner().invoke(celery_program, [*base, "limit", "tenant:1", "--limit", "none",
                                               "--rate", "5/m", "--json"])
    assert done.exit_code == 0, done.output
    group = json.loads(done.output)
    assert (group["limit"], group["limit_set"], group["rate"]) == (None, True, "5/m")


@pytest.mark.parametrize("args", [["show", ""], ["history", ""], ["release", ""],
                                  ["limit", "", "--limit", "2"]])
def test_a_bad_key_or_group_is_named_as_such_not_as_the_store_url(
        args: list[str], sqlite_url: str) -> None:
    """An empty key (or group) is refused in one line that says what is wrong with it, exit
    2: the store URL, which is fine, is not blamed."""
    base = ["-A", "tests.support.worker_app", "leases", "--store", sqlite_url]
    result = CliRunner().invoke(celery_program, [*base, *args])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "must not be empty" in lines[0], result.output
    assert "store URL" not in lines[0], result.output
