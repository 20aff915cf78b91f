"""The demo's timeline: JSON lines appended by every process that takes part.

Worker parents, prefork pool processes and the demo itself append to one file per run. Each
line is written with a single ``os.write`` on a descriptor opened with ``O_APPEND``, so the
kernel places every line at the end of the file whole: lines from different processes never
interleave or overwrite each other, and no lock is needed.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

__all__ = ["ENV", "Event", "Follower", "read", "record"]

#: The environment variable naming the file; when unset, ``record`` does nothing.
ENV = "EXAMPLE_TIMELINE"

Event = dict[str, Any]


def record(event: str, *, path: str | os.PathLike[str] | None = None, **fields: Any) -> None:
    """Append one event (``t`` = epoch seconds, ``pid`` = this process) to the timeline."""
    target = path or os.environ.get(ENV)
    if not target:
        return
    entry = {"t": time.time(), "event": event, "pid": os.getpid(), **fields}
    line = (json.dumps(entry, default=str, separators=(",", ":")) + "\n").encode()
    fd = os.open(target, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def read(path: str | os.PathLike[str]) -> list[Event]:
    """Every complete event in the file, in the order the lines were appended."""
    follower = Follower(path)
    return follower.poll()


class Follower:
    """Reads the events appended since the previous ``poll`` (the demo polls while it runs)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._offset = 0

    def poll(self) -> list[Event]:
        try:
            with self.path.open("rb") as file:
                file.seek(self._offset)
                chunk = file.read()
        except FileNotFoundError:
            return []
        end = chunk.rfind(b"\n") + 1  # a line still being written is read next time
        self._offset += end
        return [json.loads(line) for line in chunk[:end].splitlines() if line.strip()]
