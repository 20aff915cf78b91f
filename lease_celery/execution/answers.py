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

A delivery under the *same* task id is answered too when it comes from another place than the
delivery that ran (``delivery.delivery_context``: a frozen signature applied in a second
canvas); a copy of the message that ran is dropped, or its callbacks would be sent twice.

A dead key answers with the exception it died of (``stored_failure``, kept as the dead row's
result), as Celery re-raises a stored failure; one that died of no exception of its own
(takeovers, a cancel, a rejection) answers with ``LeaseDead``.
"""

from __future__ import annotations

import hashlib
from typing import Any

from celery.utils.serialization import ensure_serializable
from kombu.utils import json as kombu_json

from ..checks import MAX_KEY_LENGTH
from ..errors import LeaseDead
from ..models import LeaseRecord, LeaseState
from ..runtime.execution import Execution

__all__ = ["ANSWER_MARK", "Answer", "answer_key", "answers_elsewhere", "failure_of",
           "stored_failure"]

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


def answers_elsewhere(record: LeaseRecord, task_id: str | None, context: str | None) -> bool:
    """Is a delivery of ``task_id`` from ``context`` a new place for ``record``'s done or
    dead outcome (to answer), rather than a copy of the delivery that reached it (to drop)?
    A row that recorded no context counts every same-id delivery as a copy."""
    if record.task_id != task_id:
        return True
    return record.context is not None and context is not None and record.context != context


def stored_failure(exc: BaseException) -> dict[str, Any]:
    """``exc`` as Celery's JSON result serializer stores a failure (arguments that JSON
    cannot carry as their ``repr``): what a dead row keeps for the deliveries it answers."""
    kind = type(exc)
    return {"exc_type": getattr(kind, "__qualname__", kind.__name__),
            "exc_message": ensure_serializable(exc.args, kombu_json.dumps),
            "exc_module": kind.__module__}


def failure_of(record: LeaseRecord, backend: Any) -> BaseException:
    """What a delivery answered with ``record``'s dead outcome raises: the exception the key
    died of, rebuilt as Celery rebuilds a stored failure (``backend.exception_to_python``,
    which builds only exception types), or ``LeaseDead`` naming the reason."""
    assert record.state is LeaseState.DEAD
    error = record.result
    if isinstance(error, dict) and "exc_type" in error:
        try:
            rebuilt = backend.exception_to_python(error)
        except Exception:  # a failure that cannot be rebuilt: say the key is dead instead
            rebuilt = None
        if isinstance(rebuilt, BaseException):
            return rebuilt
    return LeaseDead(f"lease {record.key!r} is dead: {record.reason}")


class Answer(Exception):  # control flow only: never escapes the gate
    """Raised by the claim: this delivery answers ``record`` (done or dead under another task
    id) under the lease ``handle`` holds on its answer key."""

    def __init__(self, handle: Execution, record: LeaseRecord) -> None:
        super().__init__()
        self.handle, self.record = handle, record
