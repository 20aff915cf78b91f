"""The owner identity of this worker process: ``hostname:pid:uuid4``.

Made once per process (a forked child gets its own), never a fixed shared name, so two
processes can never both believe they are the holder.
"""

from __future__ import annotations

import os
import socket
import uuid

__all__ = ["process_owner"]

_owner: tuple[int, str] | None = None


def process_owner() -> str:
    global _owner
    pid = os.getpid()
    if _owner is None or _owner[0] != pid:
        _owner = (pid, f"{socket.gethostname()}:{pid}:{uuid.uuid4().hex}")
    return _owner[1]
