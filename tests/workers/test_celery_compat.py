"""``python -m benchmarks.celery_compat`` runs: a few of Celery's own integration tests, plain
and leased, each against a real in-process worker on Redis.

This checks the harness, not lease_celery: both modes ran tests, the leased run's apps had
``LeasedTask`` as their task base and its tasks wrote lease rows, the plain run's wrote none,
and in both the tests and their tasks kept their own keys in the run's Redis database.
Whether the leased run passes what the plain run passes is the command's report, not this
test's assertion.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import redis

from benchmarks.celery_compat_sdist import default_cache, fetch_sdist
from tests.support.servers import REDIS_DB, missing

REPO = Path(__file__).resolve().parents[2]
#: Short (a few seconds a mode): tasks that retry, a chain, and groups around a chain whose
#: tasks write to the tests' own Redis keys (Celery's ``get_redis_connection``).
SELECTION = ("test_simple_chain or test_group_chord_group_chain or test_retry_switches"
             " or test_retry_with_unpickleable_exception")


def test_celery_integration_tests_run_plain_and_leased(tmp_path: Path,
                                                       redis_client: redis.Redis) -> None:
    """Both modes run the same selected tests; only the leased one's apps are leased and only
    it leaves lease rows; the command prints both modes' counts and exits 0."""
    import celery

    try:  # the sdist from the package index (cached): fails in CI, skips offline elsewhere
        fetch_sdist(celery.__version__, cache=default_cache())
    except SystemExit as exc:
        missing(str(exc))
    report = tmp_path / "compat.json"
    run = subprocess.run(
        [sys.executable, "-m", "benchmarks.celery_compat", "--files", "test_canvas.py",
         "test_tasks.py", "--select", SELECTION, "--redis-db", str(REDIS_DB),
         "--timeout", "60", "--run-timeout", "120", "--workdir", str(tmp_path / "work"),
         "--json", str(report)],
        cwd=REPO, capture_output=True, text=True, timeout=330)
    assert run.returncode == 0, run.stdout + run.stderr
    result = json.loads(report.read_text())
    counts, runs = result["counts"], result["runs"]
    for mode in ("plain", "leased"):
        assert counts[mode]["tests"] >= 5 and counts[mode]["passed"] > 0, (mode, result)
        assert not runs[mode]["timed_out"], (mode, result)
        assert runs[mode]["apps"] > 0, (mode, result)  # the plugin saw the tests' apps
        assert runs[mode]["redis_helper"], (mode, result)  # their keys in the run's database
    assert counts["plain"]["tests"] == counts["leased"]["tests"], result
    assert runs["plain"]["leased_apps"] == 0 and runs["plain"]["lease_rows"] == {}, result
    assert runs["leased"]["leased_apps"] == runs["leased"]["apps"], result
    assert sum(runs["leased"]["lease_rows"].values()) > 0, result  # leased tasks really ran
    for mode in ("plain", "leased"):
        assert f"\n{mode} " in run.stdout, run.stdout
    assert "Pass plain, fail leased (" in run.stdout, run.stdout
