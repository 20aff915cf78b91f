"""Answering a duplicate that came under another task id: its own result, callbacks, chord part.

A key runs once. A delivery of the same work under *another* task id (a double publish with a
fresh id, a chord header member also published on its own, a retried publish that minted a new
id) must not simply be dropped with ``Ignore``: nothing would be stored under its id, so its
``AsyncResult`` would stay PENDING for ever, its callbacks never run, and a chord waiting for
it never complete.

Instead such a delivery is *answered*: once the key is done (or dead), Celery stores the
accepted outcome under the duplicate's own id and sends the duplicate's own callbacks and chord
part, and the body does not run again. While the key is still held, the duplicate is deferred
as before and answered when it comes back after the holder finished.

Answering is itself leased work, on a key of its own per duplicate task id
(``<key>#answer:<task id>``), so it keeps every promise a task keeps: one answer per task id
(a redelivery of an answered duplicate is dropped like any duplicate of a done key), the settle
phase between the answer and Celery's result write, and the sweeper if the answering worker
dies. Answer rows are ordinary ``done``/``dead`` rows, pruned by ``lease_retention``.
"""

from __future__ import annotations

import hashlib

from ..checks import MAX_KEY_LENGTH
from ..models import LeaseRecord
from ..runtime.execution import Execution

__all__ = ["ANSWER_MARK", "Answer", "answer_key"]

#: What separates the answered key from the duplicate's task id in an answer row's key.
ANSWER_MARK = "#answer:"


def answer_key(key: str, task_id: str) -> str:
    """The key of the row that answers delivery ``task_id`` of ``key`` (which is done under
    another task id). Readable where it fits the key limit, a digest of both where not."""
    readable = f"{key}{ANSWER_MARK}{task_id}"
    if len(readable) <= MAX_KEY_LENGTH:
        return readable
    digest = hashlib.sha256(f"{key}\0{task_id}".encode()).hexdigest()
    return f"{key[:MAX_KEY_LENGTH - 200]}…{ANSWER_MARK}{digest}"


class Answer(Exception):  # control flow only: never escapes the gate
    """Raised by the claim: this delivery answers ``record`` (done or dead under another task
    id) under the lease ``handle`` holds on its answer key."""

    def __init__(self, handle: Execution, record: LeaseRecord) -> None:
        super().__init__()
        self.handle, self.record = handle, record
