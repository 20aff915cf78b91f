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
import threading
import uuid

__all__ = ["execution_owner", "process_owner"]

#: Separates the process owner from the execution number.
EXECUTION_MARK = "/"
_executions = itertools.count(1)  # next() on a count is atomic under the GIL

_owner: tuple[int, str] | None = None
# Threads that all find no owner yet (a -P threads worker starting its tasks at once) must
# agree on one: without the lock each made its own, and --owner missed their executions.
_making = threading.Lock()


def _new_lock_in_child() -> None:
    global _making
    _making = threading.Lock()  # a fork taken while another thread held it leaves it held


os.register_at_fork(after_in_child=_new_lock_in_child)


def process_owner() -> str:
    global _owner
    pid = os.getpid()
    owner = _owner
    if owner is None or owner[0] != pid:
        with _making:
            owner = _owner
            if owner is None or owner[0] != pid:
                owner = _owner = (pid, f"{socket.gethostname()}:{pid}:{uuid.uuid4().hex}")
    return owner[1]


def execution_owner() -> str:
    """A fresh owner for one execution of this process: ``<process owner>/<n>``."""
    return f"{process_owner()}{EXECUTION_MARK}{next(_executions)}"


def owned_by(owner: str | None, wanted: str) -> bool:
    """Does ``owner`` match ``wanted``: the same execution, or an execution of that process."""
    return owner is not None and (owner == wanted or owner.startswith(wanted + EXECUTION_MARK))
