"""Celery's own integration tests, run twice against a real worker: as Celery ships them
(``plain``) and with every task a ``LeasedTask`` (``leased``), and the two compared.

    python -m benchmarks.celery_compat [--files test_canvas.py test_tasks.py] [--select EXPR]
        [--timeout 120] [--run-timeout 3600] [--redis-db 1] [--json PATH] [--workdir DIR]

What a run does:

1. takes the installed Celery's version and its source distribution of exactly that version
   from the package index (downloaded once into ``~/.cache/lease_celery/celery-compat``), and
   unpacks its ``t/integration`` tests into the work folder (``benchmarks.celery_compat_sdist``);
2. runs them with pytest twice, each run after a flush of its Redis database (broker, result
   backend, the tests' own keys and, leased, the lease store): Celery's integration conftest
   starts an in-process prefork worker (``celery.contrib.pytest``) on ``TEST_BROKER`` and
   ``TEST_BACKEND``; in the leased run the plugin ``benchmarks.celery_compat_plugin`` makes
   every app's ``task_cls`` ``lease_celery.task:LeasedTask`` (keyed by task id) with
   ``lease_store_url`` the same Redis database;
3. reads both runs' JUnit XML and prints the counts per mode, the tests that pass plain and
   fail leased (with the first line of the leased failure), and those failing in both
   (``benchmarks.celery_compat_report``); exits 0 once both ran, whatever they found.

Each test is bounded by pytest-timeout (``--timeout``; Celery's tests marked ``flaky`` keep
their own 300 s), each run by ``--run-timeout`` (then it is interrupted and what it reported
so far is compared). The Python packages the tests need are the ``compat`` dependency group:
``pip install -e . --group compat``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from benchmarks.celery_compat_report import Comparison, Outcome, compare, read_junit
from benchmarks.celery_compat_sdist import default_cache, extract_tests, fetch_sdist

REPO = Path(__file__).resolve().parents[1]
MODES = ("plain", "leased")
DEFAULT_FILES = ("test_canvas.py", "test_tasks.py")
#: Redis database 1: no test of the suite uses it (tests/support/servers.py lists theirs).
DEFAULT_REDIS_DB = 1
REDIS_HOST = os.environ.get("LEASE_TEST_REDIS_HOST", "127.0.0.1")
REDIS_PORT = int(os.environ.get("LEASE_TEST_REDIS_PORT", "6379"))
#: Seconds an interrupted run has to write its JUnit XML before it is killed.
INTERRUPT_GRACE = 60.0
#: Modules the integration tests cannot run without, and the package that brings each.
REQUIRED = {"pydantic": "pydantic", "pytest_timeout": "pytest-timeout", "redis": "redis"}


@dataclass
class Run:
    """One mode's run: its time, pytest's exit code, its outcomes and the evidence of mode."""

    mode: str
    seconds: float
    exit_code: int
    timed_out: bool
    outcomes: dict[str, Outcome]
    #: The plugin's marker: how many apps the tests created, how many of them leased.
    marker: dict[str, Any]
    #: Lease rows by state in the store after the run (none in a plain run).
    lease_rows: dict[str, int]
    log: Path

    def as_json(self) -> dict[str, Any]:
        return {"seconds": round(self.seconds, 1), "exit_code": self.exit_code,
                "timed_out": self.timed_out, "apps": self.marker.get("apps", 0),
                "leased_apps": self.marker.get("leased_apps", 0),
                "redis_helper": self.marker.get("redis_helper", False),
                "lease_rows": self.lease_rows, "log": str(self.log)}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.celery_compat",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", nargs="+", default=list(DEFAULT_FILES), metavar="FILE",
                        help="integration test files of t/integration (default: %(default)s)")
    parser.add_argument("--select", metavar="EXPR", help="only the tests pytest -k EXPR selects")
    parser.add_argument("--timeout", type=float, default=120.0,
                        help="seconds per test (pytest-timeout; default %(default)s)")
    parser.add_argument("--run-timeout", type=float, default=3600.0,
                        help="seconds per mode before its run is interrupted (%(default)s)")
    parser.add_argument("--redis-db", type=int, default=DEFAULT_REDIS_DB,
                        help="the Redis database both runs use, flushed before each "
                             "(default %(default)s)")
    parser.add_argument("--json", type=Path, metavar="PATH", help="write the comparison here")
    parser.add_argument("--workdir", type=Path,
                        help="folder for the tests, logs and JUnit files (default: a new one)")
    parser.add_argument("--cache", type=Path, default=None,
                        help="where the sdist is kept (default ~/.cache/lease_celery/"
                             "celery-compat)")
    return parser.parse_args(argv)


def check_packages() -> list[str]:
    """``SystemExit`` naming the missing packages the tests cannot run without; the warnings
    for those they run differently without."""
    missing = [package for module, package in REQUIRED.items()
               if importlib.util.find_spec(module) is None]
    if missing:
        raise SystemExit(f"celery_compat: Celery's integration tests need {', '.join(missing)}: "
                         "pip install -e . --group compat")
    if importlib.util.find_spec("pytest_rerunfailures") is None:
        return ["pytest-rerunfailures is not installed: the tests Celery marks flaky run once "
                "instead of up to 6 times (pip install -e . --group compat)"]
    return []


def redis_url(db: int) -> str:
    return f"redis://{REDIS_HOST}:{REDIS_PORT}/{db}"


def flush(url: str) -> None:
    """Empty the run's Redis database; ``SystemExit`` if Redis does not answer."""
    try:
        redis.Redis.from_url(url, socket_connect_timeout=3).flushdb()
    except redis.RedisError as exc:
        raise SystemExit(f"celery_compat: Redis at {url} is not reachable ({exc}); the tests' "
                         "broker, result backend and lease store live there") from exc


def lease_rows(store_url: str) -> dict[str, int]:
    """Rows by state in the lease store at ``store_url`` (the leased run's evidence)."""
    from lease_celery import open_store

    store = open_store(store_url)
    try:
        return dict(store.stats().counts)
    finally:
        store.close()


def _stop(process: subprocess.Popen[bytes]) -> None:
    """Interrupt pytest (it still writes its JUnit XML), then kill its process group (the
    worker's pool processes) if it has not ended within ``INTERRUPT_GRACE``."""
    process.send_signal(signal.SIGINT)
    try:
        process.wait(INTERRUPT_GRACE)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def run_mode(mode: str, *, folder: Path, workdir: Path, files: Sequence[str],
             select: str | None, timeout: float, run_timeout: float, url: str) -> Run:
    """Run the integration ``files`` in ``mode`` from ``folder``; results into ``workdir``."""
    flush(url)
    junit, marker, log = (workdir / f"{mode}.xml", workdir / f"{mode}-marker.json",
                          workdir / f"{mode}.log")
    for stale in (junit, marker):
        stale.unlink(missing_ok=True)
    # celery.contrib.pytest: the fixtures Celery's conftest asks for beyond those it imports
    # (Celery's own CI has them from pytest-celery); no:lease_celery: our fixtures stay out.
    command = [sys.executable, "-m", "pytest", "-p", "celery.contrib.pytest",
               "-p", "benchmarks.celery_compat_plugin", "-p", "no:cacheprovider",
               "-p", "no:lease_celery", "--compat-mode", mode, "--compat-redis-url", url,
               "--compat-marker", str(marker), "--junitxml", str(junit),
               "--timeout", f"{timeout:g}", "-ra", "-q",
               *[f"t/integration/{name}" for name in files]]
    if mode == "leased":
        command += ["--compat-store-url", url]
    if select:
        command += ["-k", select]
    env = {**os.environ, "TEST_BROKER": url, "TEST_BACKEND": url,
           "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get(
               "PYTHONPATH")])])}
    started = time.monotonic()
    with log.open("wb") as out:
        process = subprocess.Popen(command, cwd=folder, env=env, stdout=out,
                                   stderr=subprocess.STDOUT, start_new_session=True)
        timed_out = False
        try:
            process.wait(run_timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            _stop(process)
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
    seconds = time.monotonic() - started
    if not junit.is_file():
        tail = "\n  ".join(log.read_text(errors="replace").splitlines()[-15:])
        raise SystemExit(f"celery_compat: the {mode} run (pytest exit {process.returncode}) "
                         f"wrote no JUnit XML; the end of {log}:\n  {tail}")
    outcomes = read_junit(junit)
    if not outcomes:
        raise SystemExit(f"celery_compat: the {mode} run collected no test "
                         f"(--files {' '.join(files)}{f' --select {select!r}' if select else ''})"
                         f"; see {log}")
    seen = json.loads(marker.read_text()) if marker.is_file() else {}
    if not seen.get("redis_helper"):
        raise SystemExit(f"celery_compat: in the {mode} run, Celery's tests or tasks did not use "
                         f"the run's Redis database ({url}) for their own keys: the comparison "
                         f"would be meaningless; see {log}")
    return Run(mode, seconds, process.returncode, timed_out, outcomes, seen, lease_rows(url), log)


def _commit() -> str:
    """The short commit of the lease_celery checkout this runs from ('' outside git)."""
    try:
        found = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                               capture_output=True, text=True, timeout=10, check=False)
    except OSError:
        return ""
    return found.stdout.strip() if found.returncode == 0 else ""


def render(comparison: Comparison, runs: dict[str, Run]) -> str:
    """The comparison as the command prints it."""
    counts = comparison.counts()
    lines = [f"{'mode':<7} {'tests':>6} {'passed':>7} {'failed':>7} {'skipped':>8} "
             f"{'seconds':>8} {'apps':>5} {'leased apps':>12} {'lease rows':>11}"]
    for mode, run in runs.items():
        count = counts[mode]
        note = "  (cut short by --run-timeout)" if run.timed_out else ""
        lines.append(f"{mode:<7} {count['tests']:>6} {count['passed']:>7} {count['failed']:>7} "
                     f"{count['skipped']:>8} {run.seconds:>8.1f} {run.marker.get('apps', 0):>5} "
                     f"{run.marker.get('leased_apps', 0):>12} "
                     f"{sum(run.lease_rows.values()):>11}{note}")
    sections = [("Pass plain, fail leased", comparison.regressions),
                ("Fail in both (the leased failure)", comparison.both_fail),
                ("Fail plain, pass leased", dict.fromkeys(comparison.leased_only_pass, "")),
                ("Other differences", comparison.unmatched)]
    for title, entries in sections:
        lines += ["", f"{title} ({len(entries)}):"]
        lines += [f"  {name}" + (f": {detail}" if detail else "")
                  for name, detail in entries.items()]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    import celery

    version = celery.__version__
    warnings = check_packages()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="celery-compat-"))
    workdir.mkdir(parents=True, exist_ok=True)
    sdist = fetch_sdist(version, cache=args.cache or default_cache())
    folder = extract_tests(sdist, into=workdir / f"celery-{version}")
    absent = [name for name in args.files if not (folder / "t" / "integration" / name).is_file()]
    if absent:
        present = sorted(p.name for p in (folder / "t" / "integration").glob("test_*.py"))
        raise SystemExit(f"celery_compat: no such integration test file in Celery {version}: "
                         f"{', '.join(absent)} (there are: {', '.join(present)})")
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)
    url = redis_url(args.redis_db)
    commit = _commit()
    print(f"Celery {version}'s integration tests ({' '.join(args.files)}"
          f"{f', -k {args.select!r}' if args.select else ''}), plain then leased"
          f"{f' (lease_celery {commit})' if commit else ''}; work folder {workdir}", flush=True)
    runs = {mode: run_mode(mode, folder=folder, workdir=workdir, files=args.files,
                           select=args.select, timeout=args.timeout,
                           run_timeout=args.run_timeout, url=url)
            for mode in MODES}
    flush(url)
    comparison = compare(runs["plain"].outcomes, runs["leased"].outcomes)
    print(render(comparison, runs))
    if args.json:
        args.json.write_text(json.dumps({
            "celery": version, "lease_celery_commit": commit, "files": args.files,
            "select": args.select, "runs": {mode: run.as_json() for mode, run in runs.items()},
            **comparison.as_json()}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
