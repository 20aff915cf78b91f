"""Real ``celery worker`` processes for a run: start, kill, stop and supervise them.

Each worker is ``python -m celery -A benchmarks.chaos.app worker -P prefork -c 2`` in a process
group of its own (``start_new_session``), logging to a file of the run. A worker that dies
(the harness killed it, or it killed itself mid-sweep) is replaced by the supervisor with a
fresh one under a new name, so the run keeps its number of workers; the number of restarts is
bounded. ``stop_all`` always ends every group it started, SIGKILL after a bounded wait.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from .config import ChaosConfig
from .events import EventLog

__all__ = ["Worker", "WorkerPool", "pool_children"]

REPO = Path(__file__).resolve().parents[2]
#: Seconds a worker may take to report ready (2 cores, many processes starting at once).
READY_TIMEOUT = 60.0
#: Seconds a warm shutdown may take before the group is killed.
STOP_TIMEOUT = 15.0


@dataclass
class Worker:
    name: str
    process: subprocess.Popen[bytes]
    log: Path
    started_at: float = field(default_factory=time.time)

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def group_pids(self) -> list[int]:
        """The main process and its pool children, as they are now."""
        return [self.pid, *pool_children(self.pid)] if self.alive() else []

    def kill(self) -> None:
        """SIGKILL the whole group (main process and pool children): no cleanup at all."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(10)

    def stop(self) -> bool:
        """Warm shutdown (SIGTERM to the main process only: it lets its pool finish), SIGKILL
        of the whole group if that takes longer than ``STOP_TIMEOUT``; True if the warm
        shutdown ended the main process in time (False: it hung)."""
        ended = True
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGCONT)  # a stopped child would never finish
            os.kill(self.pid, signal.SIGTERM)
        try:
            self.process.wait(STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            ended = False
        # Pool children can outlive their main process: end the group in every case.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(10)
        return ended


def pool_children(pid: int) -> list[int]:
    """Pids whose parent is ``pid`` (the prefork pool of a worker), read from /proc."""
    children = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        # Fields after the parenthesised command name: state, ppid, ...
        fields = stat.rsplit(")", 1)[-1].split()
        if len(fields) > 1 and fields[1] == str(pid):
            children.append(int(entry))
    return children


class WorkerPool:
    def __init__(self, config: ChaosConfig, folder: Path, events: EventLog, *,
                 size: int = 3, concurrency: int = 2, max_restarts: int = 16) -> None:
        self.config, self.folder, self.events = config, folder, events
        self.size, self.concurrency, self.max_restarts = size, concurrency, max_restarts
        self.workers: list[Worker] = []
        self.restarts = 0
        self._names = 0
        self._lock = threading.RLock()
        self._stopping = threading.Event()
        self._stopped = False  # stop_all ran (it runs again from the run's cleanup)
        self._supervisor: threading.Thread | None = None

    # -- starting ---------------------------------------------------------------------------

    def _spawn(self) -> Worker:
        self._names += 1
        name = f"w{self._names}"
        log = self.folder / f"worker-{name}.log"
        env = {**os.environ, **self.config.to_env(),
               "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO),
                                                           os.environ.get("PYTHONPATH")]))}
        cmd = [sys.executable, "-m", "celery", "-A", "benchmarks.chaos.app", "worker",
               "-P", "prefork", "-c", str(self.concurrency), "-n", f"{name}@%h", "-O", "fair",
               "--without-gossip", "--without-mingle", "--without-heartbeat",
               "-l", "info", "-Q", self.config.queue]
        with log.open("wb") as out:
            process = subprocess.Popen(cmd, cwd=self.folder, env=env, stdout=out,
                                       stderr=subprocess.STDOUT, start_new_session=True)
        worker = Worker(name, process, log)
        self.workers.append(worker)
        return worker

    def _wait_ready(self, workers: list[Worker], timeout: float, *, since: int) -> None:
        """Wait for each worker's ``worker_ready`` event, reading the log from ``since``."""
        deadline = time.monotonic() + timeout
        pending = {w.pid: w for w in workers}
        seen = since
        while pending and not self._stopping.is_set():
            for event in self.events.read(seen):
                seen += 1
                if event.get("event") == "worker_ready":
                    pending.pop(int(event["pid"]), None)
            dead = [w for w in pending.values() if not w.alive()]
            if dead:
                raise RuntimeError(f"worker {dead[0].name} exited at start:\n"
                                   + dead[0].log.read_text(errors="replace")[-3000:])
            if time.monotonic() > deadline:
                names = ", ".join(w.name for w in pending.values())
                raise RuntimeError(f"workers {names} not ready after {timeout:.0f}s")
            time.sleep(0.2)

    def start(self) -> None:
        """Start ``size`` workers at once and wait until every one is ready."""
        since = self.events.length()
        with self._lock:
            started = [self._spawn() for _ in range(self.size)]
        self._wait_ready(started, READY_TIMEOUT, since=since)
        self._supervisor = threading.Thread(target=self._supervise, name="chaos-supervisor",
                                            daemon=True)
        self._supervisor.start()

    def _supervise(self) -> None:
        """Replace dead workers until the pool stops (bounded by ``max_restarts``)."""
        while not self._stopping.wait(0.5):
            with self._lock:
                dead = [w for w in self.workers if not w.alive()]
                if not dead or self.restarts >= self.max_restarts:
                    continue
                for worker in dead:
                    self.workers.remove(worker)
                since = self.events.length()
                fresh = [self._spawn() for _ in dead]
                self.restarts += len(fresh)
            for worker in dead:
                self.events.record("worker_exit", worker=worker.name, main_pid=worker.pid,
                                   returncode=worker.process.returncode)
            with contextlib.suppress(RuntimeError):  # a slow start is reported in its log
                self._wait_ready(fresh, READY_TIMEOUT, since=since)

    # -- faults -----------------------------------------------------------------------------

    def live(self) -> list[Worker]:
        with self._lock:
            return [w for w in self.workers if w.alive()]

    # -- stopping ---------------------------------------------------------------------------

    def stop_all(self) -> None:
        self._stopping.set()
        if self._supervisor is not None:
            self._supervisor.join(READY_TIMEOUT + 5)
        with self._lock:
            every = list(self.workers)
        workers = [w for w in every if w.alive()]
        hung: list[Worker] = []

        def stop(worker: Worker) -> None:
            if not worker.stop():
                hung.append(worker)

        threads = [threading.Thread(target=stop, args=(w,), daemon=True) for w in workers]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(STOP_TIMEOUT + 15)
        for worker in every:  # whatever is left (pool children can outlive their main process)
            worker.kill()
        if workers and not self._stopped:
            # A warm shutdown that did not end in STOP_TIMEOUT: the worker hung (the table
            # counts these).
            self._stopped = True
            self.events.record("workers_stopped", count=len(workers),
                               hung=sorted(w.name for w in hung))

    def logs(self) -> list[Path]:
        return sorted(self.folder.glob("worker-*.log"))
