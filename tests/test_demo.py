"""The example project's demo tells the truth: run it as a user would and check its table.

Each test runs ``python -m example_project demo`` in a subprocess at reduced size (3 reports:
one per scene) and reads the ``--json`` summary: the numbers come from the outside service's
own record, the lease store, the plain task's result table and the workers' timeline.
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

from tests.servers import REDIS_HOST, REDIS_PORT, require

#: A Redis database of these tests' own (tests/servers.py's REDIS_DB belongs to the others).
DEMO_REDIS_URL = f"redis://{REDIS_HOST}:{REDIS_PORT}/12"


def run_demo(tmp_path: Path, *extra: str) -> tuple[dict[str, Any], str]:
    summary = tmp_path / "summary.json"
    command = [sys.executable, "-m", "example_project", "demo", "--tasks", "3",
               "--data-dir", str(tmp_path / "data"), "--json", str(summary), *extra]
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=150,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert done.returncode == 0, f"demo failed:\n{done.stdout}\n{done.stderr}"
    return json.loads(summary.read_text()), done.stdout


def check_story(summary: dict[str, Any], stdout: str) -> None:
    plain, leased = summary["modes"]["plain"], summary["modes"]["leased"]
    assert plain["deliveries"] == leased["deliveries"] == 6  # the same workload twice

    # LeasedTask: one accepted result per report, no duplicate effect, the stale one refused.
    assert leased["accepted_results"] == leased["tasks"] == 3
    assert leased["duplicate_effects"] == 0
    assert leased["stale_refused"] >= 1
    assert leased["stale_accepted"] == 0
    assert leased["lost"] == 0
    assert summary["max_token"]["leased"] >= 2  # the takeovers after the crash and the stall

    # The plain task: the duplicates the scenario provokes are visible at the receiver, and the
    # stalled worker's late write lands over the newer build.
    assert plain["duplicate_effects"] >= 2   # scene 1 and scene 3, at least
    assert plain["body_executions"] > plain["tasks"]
    assert plain["accepted_results"] > plain["tasks"]
    assert plain["stale_accepted"] >= 1
    assert plain["stale_refused"] == 0
    # A SIGKILLed worker cut a delivery short in both modes: the filesystem transport cannot
    # give it back, and the report survives only through the scenario's second delivery.
    assert plain["deliveries_killed"] >= 1 and leased["deliveries_killed"] >= 1
    assert plain["lost"] == 0

    timeline = Path(summary["timeline"])
    ElementTree.parse(timeline)  # well-formed, self-contained SVG
    text = timeline.read_text()
    assert "token 2" in text and "SIGKILL" in text and "stale" in text
    assert "tasks lost" in stdout and str(timeline) in stdout


def test_demo_on_embedded_defaults(tmp_path: Path) -> None:
    """No server: filesystem broker, SQLite lease store, real prefork workers."""
    summary, stdout = run_demo(tmp_path)
    assert summary["broker_url"] == "filesystem://"
    assert summary["store_url"].startswith("sqlite:///")
    check_story(summary, stdout)
    assert "it can never redeliver it" in stdout
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
    assert "visibility_timeout" in stdout
