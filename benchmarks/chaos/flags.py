"""Fault tickets: files the harness creates and worker processes consume, one fault per file.

A fault that has to fire *inside* a worker (a sweeper killed mid-sweep, a pool process exiting
between its accepted finish and Celery's result write) cannot be injected from outside at the
right instant. The harness arms it instead: ``arm("finish_exit", count=3, probability=0.2)``
writes three ticket files; a worker process at that seam calls ``take``, which, with that
probability, unlinks one ticket. ``unlink`` succeeds for exactly one process, so the number of
faults is bounded by the tickets even when many processes race for them. ``disarm`` removes the
tickets left (the fault window is over).
"""

from __future__ import annotations

import contextlib
import os
import random
from pathlib import Path

__all__ = ["Flags"]


class Flags:
    def __init__(self, root: Path) -> None:
        self.root = root

    def _dir(self, kind: str) -> Path:
        return self.root / kind

    def arm(self, kind: str, *, count: int, probability: float = 1.0) -> None:
        folder = self._dir(kind)
        folder.mkdir(parents=True, exist_ok=True)
        # Written before the tickets, so a taker never sees tickets without a probability.
        (self.root / f"{kind}.probability").write_text(repr(probability))
        for _ in range(count):
            (folder / os.urandom(6).hex()).touch()

    def disarm(self, kind: str) -> int:
        """Remove the tickets not taken; return how many were left."""
        left = 0
        folder = self._dir(kind)
        for ticket in folder.glob("*") if folder.is_dir() else ():
            with contextlib.suppress(FileNotFoundError):
                ticket.unlink()
                left += 1
        return left

    def take(self, kind: str, rng: random.Random | None = None) -> bool:
        """Consume one ticket of ``kind`` (with its armed probability); True if this process got
        one and must now inject the fault."""
        folder = self._dir(kind)
        try:
            tickets = os.listdir(folder)
        except FileNotFoundError:
            return False
        if not tickets:
            return False
        try:
            probability = float((self.root / f"{kind}.probability").read_text())
        except (FileNotFoundError, ValueError):
            probability = 1.0
        if (rng or random).random() >= probability:
            return False
        for name in tickets:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(folder / name)
                return True
        return False
