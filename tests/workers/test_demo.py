"""The example project's demo tells the truth: run it as a user would and check its table.

Each test runs ``python -m example_project demo`` in a subprocess at reduced size (3 reports:
one per scene; report 2 is scene 2's lone delivery whose worker is SIGKILLed) and reads the
``--json`` summary: the numbers come from the outside service's own record, the lease store,
the plain task's result table and the workers' timeline.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import Any

import pytest
import redis

from tests.support.servers import REDIS_HOST, REDIS_PORT, require

#: The checkout: the example project runs from it (it is not installed).
REPO = Path(__file__).resolve().parents[2]
#: A Redis database of these tests' own (tests/support/servers.py's REDIS_DB belongs to the others).
DEMO_REDIS_URL = f"redis://{REDIS_HOST}:{REDIS_PORT}/12"


def run_demo(tmp_path: Path, *extra: str) -> tuple[dict[str, Any], str]:
    summary = tmp_path / "summary.json"
    command = [sys.executable, "-m", "example_project", "demo", "--tasks", "3",
               "--data-dir", str(tmp_path / "data"), "--json", str(summary), *extra]
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=150,
                          # The example project is not installed: it runs from the checkout.
                          env={**os.environ, "PYTHONUNBUFFERED": "1",
                               "PYTHONPATH": os.pathsep.join(
                                   [str(REPO), os.environ.get("PYTHONPATH", "")])})
    assert done.returncode == 0, f"demo failed:\n{done.stdout}\n{done.stderr}"
    return json.loads(summary.read_text()), done.stdout


def check_story(summary: dict[str, Any], stdout: str) -> None:
    """The facts that hold on every broker the tests use (filesystem, Redis)."""
    plain, leased = summary["modes"]["plain"], summary["modes"]["leased"]
    # The same workload twice: scenes 1 and 3 publish their report twice, scene 2 once.
    assert plain["deliveries"] == leased["deliveries"] == 5

    # LeasedTask: one accepted result per report, no duplicate effect, the stale one refused,
    # nothing lost: the lone delivery whose worker was SIGKILLed came back through the sweeper.
    assert leased["accepted_results"] == leased["tasks"] == 3
    assert leased["duplicate_effects"] == 0
    assert leased["stale_refused"] >= 1
    assert leased["stale_accepted"] == 0
    assert leased["lost"] == 0
    assert leased["deliveries_killed"] == 1
    assert leased["swept"] >= 1
    killed = summary["killed"]["leased"]  # report -> the execution that completed it after all
    assert list(killed) == ["2"]
    assert killed["2"]["origin"] == "sweeper" and killed["2"]["token"] == 2
    assert summary["max_token"]["leased"] >= 2  # the takeovers after the SIGKILL and the stall

    # The plain task: the duplicates the scenario provokes are visible at the receiver, and the
    # stalled worker's late write lands over the newer build.
    assert plain["duplicate_effects"] >= 2   # scene 1 and scene 3, at least
    assert plain["body_executions"] > plain["tasks"]
    assert plain["accepted_results"] > plain["tasks"]
    assert plain["stale_accepted"] >= 1
    assert plain["stale_refused"] == 0
    assert plain["swept"] == 0  # a plain deployment has no sweeper
    assert plain["deliveries_killed"] == 1

    timeline = Path(summary["timeline"])
    ElementTree.parse(timeline)  # well-formed, self-contained SVG
    text = timeline.read_text()
    assert "token 2" in text and "SIGKILL" in text and "stale" in text and "swept" in text
    assert "tasks lost" in stdout and str(timeline) in stdout
    assert "re-published the task recorded on the lease row" in stdout


def check_plain_lost(summary: dict[str, Any]) -> None:
    """Neither the filesystem transport nor Redis (within the demo) gives the killed one back."""
    plain = summary["modes"]["plain"]
    assert plain["lost"] == 1 and plain["lost_reports"] == [2]  # scene 2's lone delivery
    assert summary["killed"]["plain"] == {"2": None}
    assert plain["broker_redeliveries"] == 0


def test_demo_on_embedded_defaults(tmp_path: Path) -> None:
    """No server: filesystem broker, SQLite lease store, real prefork workers."""
    summary, stdout = run_demo(tmp_path)
    assert summary["broker_url"] == "filesystem://"
    assert summary["store_url"].startswith("sqlite:///")
    check_story(summary, stdout)
    check_plain_lost(summary)
    # The transport deleted the message when the worker fetched it: there is nothing to wait for.
    assert "it can never redeliver it" in stdout
    assert "its folder holds 0 message(s) of the queue" in stdout
    assert "report 2 lost: the filesystem transport deleted the message" in stdout
    assert summary["wall_seconds"] < 60


@pytest.mark.worker
def test_demo_on_redis(tmp_path: Path) -> None:
    """The same story on Redis (db 12, flushed before and after): the same facts hold."""
    client = redis.Redis.from_url(DEMO_REDIS_URL, socket_connect_timeout=2)
    try:
        client.ping()
    except redis.RedisError as exc:
        require("Redis", False, f"{DEMO_REDIS_URL}: {exc}")
    client.flushdb()
    try:
        summary, stdout = run_demo(tmp_path, "--broker", DEMO_REDIS_URL)
    finally:
        client.flushdb()
    assert summary["broker_url"] == DEMO_REDIS_URL
    check_story(summary, stdout)
    # Redis keeps the killed worker's message unacked and would restore it after
    # visibility_timeout (1 h: the demo leaves kombu's default), long after the demo ends: lost
    # within the demo, and the demo says so. It then removes those messages with its queues.
    check_plain_lost(summary)
    assert "1 unacked message(s) of the queue" in stdout
    assert "report 2 lost within the demo: Redis still held" in stdout
    assert "removed 2 unacked message(s)" in stdout
