"""CPU load beside a worker: busy-loop processes that compete with it for a core.

Issue 20 saw a green worker lose a lease on a loaded machine (load above 3 on 2 cores) that
an idle machine never showed. ``cpu_load`` recreates that for a test's workers: two
interpreters running ``while True: pass`` and the workers' threads pinned to one core, where
every thread of the worker waits for the core behind them (about a third of a core each).
Pinned, they leave the other core to the rest of the suite: with ``-n 2`` the other test
process runs timing-tight tests (2 s ttls) that two unpinned busy loops would starve too.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager, suppress

__all__ = ["BUSY_LOOPS", "BusyCore", "cpu_load"]

#: Busy-loop processes beside the worker, as in the issue (2 cores, load above 3).
BUSY_LOOPS = 2


def _pin(pid: int, cpus: set[int]) -> None:
    """Pin every thread of process ``pid`` to ``cpus``; threads it starts later inherit that
    from the thread that starts them. A process or thread that ended meanwhile is skipped."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return
    for tid in tids:
        with suppress(ProcessLookupError):
            os.sched_setaffinity(int(tid), cpus)


class BusyCore:
    """Busy loops on one core, and the processes pinned beside them (``pin``)."""

    def __init__(self, processes: int = BUSY_LOOPS) -> None:
        self._allowed = os.sched_getaffinity(0)
        self.cpu = max(self._allowed)
        self._pinned: list[int] = []
        self._loops: list[subprocess.Popen[bytes]] = []
        try:
            for _ in range(processes):
                self._loops.append(subprocess.Popen([sys.executable, "-c", "while True: pass"]))
                os.sched_setaffinity(self._loops[-1].pid, {self.cpu})
        except BaseException:
            self.stop()  # no loop outlives a failed start
            raise

    def pin(self, pid: int) -> None:
        """Put process ``pid`` (a started worker) on the busy core, every thread of it."""
        self._pinned.append(pid)
        _pin(pid, {self.cpu})

    def stop(self) -> None:
        """Kill and reap the loops; the pinned processes may use every core again (a worker
        outlives the load: its shutdown)."""
        for loop in self._loops:
            loop.kill()
        for loop in self._loops:
            loop.wait(10)
        for pid in self._pinned:
            _pin(pid, self._allowed)


@contextmanager
def cpu_load(processes: int = BUSY_LOOPS) -> Iterator[BusyCore]:
    """``processes`` busy loops on one core for the block; ``pin`` a worker beside them."""
    core = BusyCore(processes)
    try:
        yield core
    finally:
        core.stop()
