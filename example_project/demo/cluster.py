"""The processes the demo starts: real ``celery worker`` processes and the outside service.

Every process gets a session of its own, so that SIGKILL of a worker takes its pool processes
with it (as the OOM killer or a node failure would) and nothing outlives the demo.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

__all__ = ["DemoError", "Receiver", "Worker", "start_receiver", "start_worker"]

#: Prefork with one pool process per worker: a busy worker cannot fetch a second message, so
#: which worker gets a duplicate delivery does not depend on luck.
WORKER_OPTIONS = ["-P", "prefork", "-c", "1", "-O", "fair", "--without-gossip",
                  "--without-mingle", "--without-heartbeat", "-l", "info"]


class DemoError(RuntimeError):
    """The demo could not play a scene (a worker did not start, an expected event never came)."""


@dataclass
class Worker:
    name: str
    hostname: str
    process: subprocess.Popen[bytes]
    log: Path
    killed: bool = False

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        """SIGKILL the worker and its pool processes at once: no cleanup, no goodbye."""
        if self.alive():
            os.killpg(self.pid, signal.SIGKILL)
        self.process.wait(10)
        self.killed = True

    def stop(self, timeout: float = 10.0) -> None:
        """Warm shutdown (SIGTERM), then SIGKILL if it takes longer than ``timeout``."""
        if not self.alive():
            return
        os.killpg(self.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.pid, signal.SIGKILL)
            self.process.wait(10)

    def log_tail(self, lines: int = 25) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


def start_worker(name: str, *, domain: str, queue: str, env: dict[str, str],
                 log_dir: Path) -> Worker:
    hostname = f"{name}@{domain}"
    log = log_dir / f"worker-{name}.log"
    command = [sys.executable, "-m", "celery", "-A", "example_project.app", "worker",
               "-n", hostname, "-Q", queue, *WORKER_OPTIONS]
    with log.open("wb") as out:
        process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, start_new_session=True)
    return Worker(name, hostname, process, log)


@dataclass
class Receiver:
    process: subprocess.Popen[bytes]
    url: str

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(5)


def start_receiver(db: Path, log: Path) -> Receiver:
    """Start the outside service on a free port of 127.0.0.1; return once it listens."""
    with log.open("wb") as err:
        process = subprocess.Popen(
            [sys.executable, "-m", "example_project.receiver", "--db", str(db)],
            stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL,
            start_new_session=True)
    assert process.stdout is not None
    first = process.stdout.readline().decode().strip()  # printed once the socket is bound
    if not first.startswith("listening on "):
        process.kill()
        raise DemoError(f"the outside service did not start: {first!r}\n"
                        f"{log.read_text(errors='replace')}")
    return Receiver(process, first.removeprefix("listening on "))
