"""Helpers for the failure-policy, CLI, doctor and metrics tests: the real ``celery leases``
command in a subprocess, a free port, a Prometheus scrape, a look at a lease row."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from lease_celery import LeaseRecord, open_store
from tests.support.servers import REDIS_URL

REPO = Path(__file__).resolve().parents[2]

#: The two ways to run the commands: Celery's program (entry point ``celery.commands``) and
#: ``python -m lease_celery``; both take the app with ``-A``.
CELERY = [sys.executable, "-m", "celery", "-A", "tests.support.worker_app", "leases"]
PYTHON_M = [sys.executable, "-m", "lease_celery", "-A", "tests.support.worker_app"]


def cli_env(store_url: str, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment tests/support/worker_app.py reads, pointing at ``store_url``."""
    env = {**os.environ, "LEASE_TEST_STORE": store_url, "LEASE_TEST_BROKER": REDIS_URL,
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    env.update(extra or {})
    return env


def run_cli(args: list[str], *, env: Mapping[str, str], cwd: Path,
            program: list[str] = CELERY, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Run ``celery -A tests.support.worker_app leases ARGS`` (or ``program``) and return its
    outcome."""
    return subprocess.run([*program, *args], env=dict(env), cwd=cwd, capture_output=True,
                          text=True, timeout=timeout)


def parse_json(proc: subprocess.CompletedProcess[str]) -> Any:
    """The command's ``--json`` output, with its stderr in the message when it is not JSON."""
    try:
        return json.loads(proc.stdout)
    except ValueError as exc:
        raise AssertionError(f"not JSON (exit {proc.returncode}): {proc.stdout!r}\n"
                             f"stderr: {proc.stderr}") from exc


def get_record(store_url: str, key: str) -> LeaseRecord | None:
    with open_store(store_url) as store:
        return store.get(key)


def wait_until(predicate: Callable[[], Any], *, timeout: float, what: str,
               interval: float = 0.05) -> Any:
    """Poll ``predicate`` until it returns something truthy; return that."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def scrape(port: int) -> dict[str, float]:
    """GET http://127.0.0.1:PORT/metrics; every sample summed over its labels, by name."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode("utf-8")
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[sample.name] = samples.get(sample.name, 0.0) + sample.value
    return samples


def sweep_in_process(store_url: str, barrier: Any, out: Any) -> None:
    """A sweeper in a process of its own (test_store_operations): once every sweeper is ready,
    sweep a few rows at a time until nothing is left, then report the keys and tokens it got."""
    got: list[tuple[str, int]] = []
    with open_store(store_url) as store:
        store.now()  # connected before the start line
        barrier.wait(30)
        while True:
            swept = store.sweep_expired(limit=3)
            if not swept:
                break
            got += [(record.key, record.token) for record in swept]
    out.put(got)
