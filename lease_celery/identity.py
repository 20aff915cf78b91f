"""Owner identities: ``hostname:pid:uuid4`` per worker process, ``…/n`` per execution.

The process part is made once per process (a forked child gets its own), never a fixed shared
name, so two processes can never both believe they are the holder. Each execution (claim) in
the process adds its own number, so the executions one process runs at once (``-P threads``,
gevent, eventlet) are told apart in ``celery leases list --owner``; ``--owner`` given a
process's owner lists all of that process's executions.
"""

from __future__ import annotations

import itertools
import os
import socket
import uuid

__all__ = ["execution_owner", "process_owner"]

#: Separates the process owner from the execution number.
EXECUTION_MARK = "/"
_executions = itertools.count(1)  # next() on a count is atomic under the GIL

_owner: tuple[int, str] | None = None


def process_owner() -> str:
    global _owner
    pid = os.getpid()
    if _owner is None or _owner[0] != pid:
        _owner = (pid, f"{socket.gethostname()}:{pid}:{uuid.uuid4().hex}")
    return _owner[1]


def execution_owner() -> str:
    """A fresh owner for one execution of this process: ``<process owner>/<n>``."""
    return f"{process_owner()}{EXECUTION_MARK}{next(_executions)}"


def owned_by(owner: str | None, wanted: str) -> bool:
    """Does ``owner`` match ``wanted``: the same execution, or an execution of that process."""
    return owner is not None and (owner == wanted or owner.startswith(wanted + EXECUTION_MARK))
