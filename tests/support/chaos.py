"""One chaos harness run from a test: ``python -m benchmarks.chaos ARGS`` in a process of its
own, bounded in time, its output in the failure message (tests/workers/test_chaos*.py,
tests/django_integration/test_chaos_run.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Mapping

import pytest

from tests.support.workers import REPO

__all__ = ["REPO", "run_chaos"]


def run_chaos(args: list[str], *, timeout: float, what: str,
              env: Mapping[str, str] | None = None) -> str:
    """Run the harness with ``args``; fail the test (with the run's output) unless it exits 0
    within ``timeout`` seconds. Returns the output (the report's table)."""
    process = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.chaos", *args],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**(os.environ if env is None else env), "PYTHONPATH": str(REPO)})
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # SIGTERM first: the harness then stops its workers and deletes its keys and schema.
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=60)
        pytest.fail(f"{what} took more than {timeout}s:\n{output}")
    assert process.returncode == 0, f"{what} failed:\n{output}"
    return output
