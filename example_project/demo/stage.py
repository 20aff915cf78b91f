"""What a scene acts on: the workers, the timeline, the publisher and the narrator.

Everything the demo does to the workers (publish, SIGKILL, SIGSTOP, SIGCONT) is recorded in
the same timeline as what the workers did, so the picture and the table come from one record.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from .. import timeline
from .brokers import Broker
from .cluster import DemoError, Worker
from .history import History
from .tally import deliveries_killed

__all__ = ["Mode", "Stage"]

_T = TypeVar("_T")

#: Seconds between two looks at the timeline while waiting for something to happen.
POLL = 0.02


@dataclass(frozen=True)
class Mode:
    name: str      # "plain" or "leased"
    title: str     # for people
    task: Any      # the Celery task the mode publishes
    leased: bool


class Stage:
    def __init__(self, *, mode: Mode, edition: str, queue: str, broker: Broker,
                 receiver_url: str, timeline_path: Path, workers: list[Worker], ttl: float,
                 sweep_interval: float, build_seconds: float,
                 say: Callable[[str], None]) -> None:
        self.mode, self.edition, self.queue = mode, edition, queue
        self.broker, self.receiver_url = broker, receiver_url
        self.timeline_path = timeline_path
        self.workers = workers
        self.ttl, self.build_seconds = ttl, build_seconds
        self.sweep_interval = sweep_interval
        self._say = say
        self._follower = timeline.Follower(timeline_path)
        self.events: list[timeline.Event] = []

    # -- looking ----------------------------------------------------------------------------

    def refresh(self) -> History:
        self.events.extend(self._follower.poll())
        return History.parse(self.events)

    def wait(self, look: Callable[[History], _T | None], *, timeout: float, what: str) -> _T:
        """Poll the timeline until ``look`` returns something other than None/False."""
        deadline = time.monotonic() + timeout
        while True:
            found = look(self.refresh())
            if found:
                return found
            for worker in self.workers:
                if not worker.killed and not worker.alive():
                    raise DemoError(f"worker {worker.name} exited unexpectedly:\n"
                                    f"{worker.log_tail()}")
            if time.monotonic() > deadline:
                raise DemoError(f"{self.mode.name}: waited {timeout:g}s for {what}; see "
                                f"{self.timeline_path} and the worker logs beside it")
            time.sleep(POLL)

    def settle(self, *, timeout: float = 20.0, quiet: float = 0.4) -> None:
        """Wait until every delivery in flight has ended: run, deferred, ignored or killed.

        In flight = published by the demo + re-published by a deferral or by the sweeper -
        ended. A delivery ends with its postrun, or when the worker holding it (running or
        waiting for its countdown) is SIGKILLed. A broker that redelivers by itself adds
        deliveries nobody published, so "ended >= sent" plus a short quiet period is the test.
        (A sweep that has not happened yet is not in flight: a scene that expects one waits
        for it first.)
        """
        last_count = -1
        quiet_since = time.monotonic()

        def done(history: History) -> bool:
            nonlocal last_count, quiet_since
            if len(history.events) != last_count:
                last_count, quiet_since = len(history.events), time.monotonic()
            sent = (len(history.of("published")) + len(history.of("duplicate_deferred"))
                    + len(history.of("lease_swept")))
            ended = len(history.of("postrun")) + deliveries_killed(history)
            running = [x for x in history.executions if x.end is None]
            return ended >= sent and not running and time.monotonic() - quiet_since >= quiet

        self.wait(done, timeout=timeout, what="every delivery in flight to end")

    # -- acting -----------------------------------------------------------------------------

    def say(self, text: str) -> None:
        self._say(text)

    def record(self, event: str, **fields: Any) -> None:
        timeline.record(event, path=self.timeline_path, by="demo", **fields)

    def publish(self, report_id: int, *, copy: int, task_id: str | None = None) -> str:
        """Publish one delivery of ``report_id``; ``task_id`` of an earlier one = a redelivery.

        A broker redelivers the same message, so the copy keeps the task id; the ``demo_copy``
        header only lets the timeline tell the copies apart.
        """
        task_id = task_id or str(uuid.uuid4())
        self.record("published", report_id=report_id, task_id=task_id, copy=str(copy))
        self.mode.task.apply_async((self.edition, report_id), task_id=task_id,
                                   queue=self.queue, headers={"demo_copy": str(copy)})
        return task_id

    def worker(self, hostname: str) -> Worker:
        for worker in self.workers:
            if worker.hostname == hostname:
                return worker
        raise DemoError(f"no worker named {hostname}")

    def worker_by_pid(self, pid: int) -> Worker | None:
        """The worker whose main process is ``pid`` (where the sweeper thread runs)."""
        return next((w for w in self.workers if w.pid == pid), None)

    def kill(self, worker: Worker) -> list[int]:
        """SIGKILL ``worker``; return its pid and the pids of the pool processes it had."""
        pool = {e["pid"] for e in self.events
                if e.get("worker") == worker.hostname and e["event"] == "prerun"}
        pids = [worker.pid, *sorted(pool)]
        worker.kill()
        self.record("worker_killed", worker=worker.hostname, pids=pids)
        return pids

    def stop_process(self, pid: int) -> None:
        os.kill(pid, signal.SIGSTOP)
        self.record("stalled", target=pid)

    def continue_process(self, pid: int) -> None:
        os.kill(pid, signal.SIGCONT)
        self.record("resumed", target=pid)
