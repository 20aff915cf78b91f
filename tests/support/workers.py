"""Start and stop real ``celery worker`` processes running tests/support/worker_app.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import redis

REPO = Path(__file__).resolve().parents[2]


class Journal:
    """The Redis list the worker app writes events to (see worker_app.record)."""

    def __init__(self, client: redis.Redis, key: str) -> None:
        self.client, self.key = client, key

    def events(self, name: str | None = None, **match: Any) -> list[dict[str, Any]]:
        entries = [json.loads(raw) for raw in self.client.lrange(self.key, 0, -1)]
        return [e for e in entries if (name is None or e["event"] == name)
                and all(e.get(k) == v for k, v in match.items())]

    def wait_for(self, predicate: Callable[[Journal], bool], *, timeout: float,
                 what: str) -> None:
        deadline = time.monotonic() + timeout
        while not predicate(self):
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout}s waiting for {what}; journal:\n"
                                     + "\n".join(map(str, self.events())))
            time.sleep(0.05)


class Worker:
    def __init__(self, name: str, process: subprocess.Popen[bytes], log: Path) -> None:
        self.name, self.process, self.log = name, process, log

    def kill(self) -> None:
        """SIGKILL the whole worker: the parent and every pool process, with no cleanup."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(10)

    def stop(self) -> None:
        self.terminate()
        self.join()

    def terminate(self) -> None:
        """Begin a warm shutdown (SIGTERM to the whole group)."""
        if self.process.poll() is None:
            with suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)

    def join(self, timeout: float = 10.0) -> None:
        """Wait for the shutdown begun by ``terminate``; SIGKILL the group past ``timeout``."""
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            with suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(10)

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


class WorkerPool:
    """Starts workers that share one broker queue, lease store and journal."""

    def __init__(self, *, tmp: Path, env: dict[str, str], journal: Journal) -> None:
        self.tmp, self.env, self.journal = tmp, env, journal
        self.workers: list[Worker] = []
        self.client: Any = None  # set by the fixture: a Celery app publishing to this queue
        self.store_url = ""

    def start(self, name: str, *, concurrency: int = 2, ready_timeout: float = 30.0,
              extra_env: dict[str, str] | None = None, app: str = "tests.support.worker_app",
              pool: str = "prefork", queue: str | None = None) -> Worker:
        """``celery -A app worker -P pool`` on ``queue`` (default this pool's queue); returns
        once it is ready."""
        log = self.tmp / f"worker-{name}.log"
        env = {**os.environ, **self.env, **(extra_env or {}),
               "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
        # -O fair is the prefork pool's scheduling: the other pools have no use for it.
        fair = ["-O", "fair"] if pool == "prefork" else []
        cmd = [sys.executable, "-m", "celery", "-A", app, "worker",
               "-P", pool, "-c", str(concurrency), "-n", f"{name}@%h", *fair,
               "--without-gossip", "--without-mingle", "--without-heartbeat",
               "-l", "info", "-Q", queue or self.env["LEASE_TEST_QUEUE"]]
        with log.open("wb") as out:
            process = subprocess.Popen(cmd, cwd=self.tmp, env=env, stdout=out,
                                       stderr=subprocess.STDOUT, start_new_session=True)
        worker = Worker(name, process, log)
        self.workers.append(worker)
        try:
            self.journal.wait_for(
                lambda j: bool(j.events("worker_ready", hostname=f"{name}@{os.uname().nodename}"))
                or process.poll() is not None,
                timeout=ready_timeout, what=f"worker {name} to be ready")
        except AssertionError:
            raise AssertionError(f"worker {name} did not start:\n{worker.output()}") from None
        if process.poll() is not None:
            raise AssertionError(f"worker {name} exited with {process.returncode}:\n"
                                 f"{worker.output()}")
        return worker

    def stop_all(self) -> None:
        """Warm-shut every worker down at once, then wait for each: a warm shutdown takes
        Celery about a second even when idle, and one after another those seconds add up."""
        for worker in self.workers:
            worker.terminate()
        for worker in self.workers:
            worker.join()

    def logs(self) -> str:
        return "\n".join(f"----- {w.name} -----\n{w.output()}" for w in self.workers)


@contextmanager
def worker_pool(tmp: Path, env: dict[str, str], journal: Journal) -> Iterator[WorkerPool]:
    pool = WorkerPool(tmp=tmp, env=env, journal=journal)
    try:
        yield pool
    finally:
        pool.stop_all()


def client_app(broker_url: str, queue: str) -> Any:
    """A Celery app for the test process: publishes to the workers' queue, reads results."""
    from celery import Celery

    app = Celery("lease-tests-client", broker=broker_url, backend=broker_url)
    app.conf.task_default_queue = queue
    return app


def broker_env(request: Any, *, broker_url: str, result_backend: str, journal_redis: str,
               worker_store: str) -> dict[str, str]:
    """The environment of workers on a broker other than the tests' Redis (RabbitMQ, SQS):
    a queue and a journal of the test's own, the journal on Redis; a test's ``worker_env``
    marker overrides it."""
    run = uuid.uuid4().hex[:8]
    env = {"LEASE_TEST_BROKER": broker_url, "LEASE_TEST_RESULT_BACKEND": result_backend,
           "LEASE_TEST_JOURNAL_REDIS": journal_redis, "LEASE_TEST_QUEUE": f"lease-tests-{run}",
           "LEASE_TEST_JOURNAL": f"journal-{run}", "LEASE_TEST_STORE": worker_store}
    marker = request.node.get_closest_marker("worker_env")
    if marker is not None:
        env.update(marker.kwargs)
    return env


@contextmanager
def client_pool(request: Any, tmp: Path, env: dict[str, str], journal: Journal, client: Any,
                worker_store: str) -> Iterator[WorkerPool]:
    """A worker pool publishing through ``client`` (closed after); a failed test prints the
    workers' logs."""
    try:
        with worker_pool(tmp, env, journal) as pool:
            pool.client, pool.store_url = client, worker_store
            yield pool
            if request.node.rep_call.failed if hasattr(request.node, "rep_call") else False:
                print(pool.logs())
    finally:
        client.close()
