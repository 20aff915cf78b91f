"""README's promises, executed: the quickstart runs as written, the set-up is two commands."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from tests.support.servers import REDIS_URL

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()
#: The quickstart's store: an absolute path (doctor warns about relative ones), which the test
#: points at a file of its own.
QUICKSTART_STORE = "sqlite:////tmp/lease_celery_quickstart.sqlite3"


def quickstart_files() -> dict[str, str]:
    blocks = re.findall(r"<!-- quickstart:(\S+) -->\n```python\n(.*?)```", README, re.DOTALL)
    return dict(blocks)


def test_readme_gives_exactly_two_setup_commands() -> None:
    """The block under "Try it" holds two commands: the demo and the tests (CI runs the
    latter). (The first screen is the user's: what it is, how to install it, how it compares.)"""
    first_block = re.search(r"^## Try it[^\n]*\n(?:[^`]*\n)?```bash\n(.*?)```", README,
                            re.DOTALL | re.MULTILINE)
    assert first_block is not None
    commands = [line for line in first_block.group(1).splitlines()
                if line.strip() and not line.lstrip().startswith("#")]
    assert len(commands) == 2
    assert "example_project demo" in commands[0]
    assert commands[1] == "bash .ci/run"


def test_quickstart_passes_doctor(tmp_path: Path) -> None:
    """``celery -A tasks leases doctor`` on the README's tasks.py, as written (only its store
    file moved to the test's own): no warning and no error, so the first check a newcomer
    runs on the quickstart agrees with it."""
    (tmp_path / "tasks.py").write_text(quickstart_files()["tasks.py"].replace(
        QUICKSTART_STORE, f"sqlite:///{tmp_path}/leases.sqlite3"))
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    doctor = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "tasks", "leases", "--json", "doctor"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=90)
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr
    findings = json.loads(doctor.stdout)
    assert [f for f in findings if f["severity"] != "ok"] == [], findings


@pytest.mark.worker
def test_quickstart_runs_as_written(tmp_path: Path, redis_client: redis.Redis) -> None:
    """tasks.py and client.py from the README, a real ``celery -A tasks worker``: the client
    prints the accepted result and the lease record, exactly as the README says."""
    files = quickstart_files()
    assert set(files) == {"tasks.py", "client.py"}
    for name, text in files.items():
        assert QUICKSTART_STORE in text, name  # both files name the one store
        (tmp_path / name).write_text(
            text.replace(QUICKSTART_STORE, f"sqlite:///{tmp_path}/leases.sqlite3"))
    # Celery's own environment overrides point the README's Redis URLs at the test database.
    env = {**os.environ, "CELERY_BROKER_URL": REDIS_URL, "CELERY_RESULT_BACKEND": REDIS_URL,
           "PYTHONPATH": str(tmp_path)}
    worker = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "tasks", "worker", "-P", "prefork", "-c", "2",
         "--without-gossip", "--without-mingle", "-l", "info"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        start_new_session=True)
    try:
        client = subprocess.run([sys.executable, "client.py"], cwd=tmp_path, env=env,
                                capture_output=True, text=True, timeout=90)
        assert client.returncode == 0, client.stderr
        assert client.stdout.splitlines() == [
            "{'report': 42, 'token': 1}",
            "done 1 {'report': 42, 'token': 1}",
        ]
    finally:
        os.killpg(worker.pid, signal.SIGTERM)
        try:
            worker.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(worker.pid, signal.SIGKILL)

