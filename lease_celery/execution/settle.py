"""The settle protocol on the task side: from the accepted outcome to Celery's result write.

``finish`` (or ``kill``) leaves the key *settling*: done (dead) on the row, with a settle
deadline the heartbeat keeps alive. Celery then sends callbacks and stores the outcome
(``celery/app/trace.py``: callbacks first, then ``mark_as_done``, then ``after_return``).
``after_return`` queues the owner's confirmation on the heartbeat thread, which ends the phase
in a batched write. If the owner dies before confirming, its renewals stop, the deadline
passes, and a delivery of the same task id (the broker's redelivery or the sweeper's
re-publish) completes the key: it stores the accepted outcome and sends the callbacks again.
The row is the record: the result backend is asked only by a delivery that took a settlement
over, whether Celery stored the task's SUCCESS already (the owner was slow, not dead: then it
only confirms the settlement). ``rpc://`` answers PENDING inside a worker, so with it the
delivery stores the outcome again.

Callbacks are therefore sent at least once. So that a re-sent callback is recognisable, every
``link`` and ``link_error`` signature without a task id gets one derived from this task's id
before Celery sends it: every execution of one task id sends its callbacks under the same ids,
and a LeasedTask callback (keyed by its task id, the default) runs once.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import MutableMapping
from typing import Any

from celery import signals as celery_signals
from celery import states

from ..runtime.execution import Execution, Phase
from ..runtime.heartbeat import Heartbeat

__all__ = ["SettlementCheck", "confirm_stored", "freeze_links"]

logger = logging.getLogger(__name__)

#: Namespace of the derived callback ids (uuid5 over "<task id>:<field>:<index>").
_CALLBACK_IDS = uuid.UUID("6f1c3c2e-6d0b-4bb0-9a59-3b3f7f5ad0c1")

#: The outcomes Celery stores for a finished (``done``) or killed (``dead``) key.
_STORED = frozenset({states.SUCCESS, states.FAILURE})


def _derived_id(task_id: str, field: str, *path: int) -> str:
    name = ":".join([task_id, field, *map(str, path)])
    return str(uuid.uuid5(_CALLBACK_IDS, name))


def _freeze(signature: Any, task_id: str, field: str, *path: int) -> None:
    if not isinstance(signature, MutableMapping):
        return
    options = signature.get("options")
    if not isinstance(options, MutableMapping):
        options = signature["options"] = {}
    if signature.get("task") == "celery.group":
        # A group's members are sent under ids of their own; each gets a derived one.
        members = (signature.get("kwargs") or {}).get("tasks") or []
        for index, member in enumerate(members):
            _freeze(member, task_id, field, *path, index)
    if not options.get("task_id"):
        options["task_id"] = _derived_id(task_id, field, *path)


def freeze_links(request: Any) -> None:
    """Give every callback and errback of ``request`` a task id derived from the task's id.

    Signatures that already carry an id (frozen by their publisher, chain steps) keep it.
    """
    task_id = getattr(request, "id", None)
    if not task_id:
        return
    for field in ("callbacks", "errbacks"):
        for index, signature in enumerate(getattr(request, field, None) or ()):
            _freeze(signature, task_id, field, index)


class SettlementCheck:
    """Celery's result backend, as an owner that stalled past its settle deadline sees it
    (frozen between its accepted finish and Celery's result write): the outcome is stored only
    if the settlement is still this owner's. A delivery that took it over meanwhile stores the
    outcome itself, so a second write by the owner would be the same result written twice.
    Everything but the two writes passes through; a store that cannot answer lets the write
    through (a result written twice is better than none)."""

    def __init__(self, backend: Any, handle: Execution) -> None:
        self._backend, self._handle = backend, handle

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)

    def _still_ours(self) -> bool:
        handle = self._handle
        if handle.holds_row() is not False:  # ours, or the store cannot say
            return True
        logger.warning("lease %s token %s: this owner stalled past its settle deadline and "
                       "another delivery completed the key: its outcome is not stored again",
                       handle.key, handle.token)
        return False

    def mark_as_done(self, *args: Any, **kwargs: Any) -> Any:
        return self._backend.mark_as_done(*args, **kwargs) if self._still_ours() else None

    def mark_as_failure(self, *args: Any, **kwargs: Any) -> Any:
        return self._backend.mark_as_failure(*args, **kwargs) if self._still_ours() else None


def confirm_stored(handle: Execution | None, state: str) -> None:
    """Celery stored the outcome of the execution ``handle``: end its settle phase."""
    if handle is None or handle.phase is not Phase.SETTLING or state not in _STORED:
        return
    Heartbeat.for_process().settle(handle)


def _stop_renewing_unconfirmed(sender: Any = None, task: Any = None, **_: Any) -> None:
    """The execution ended without ``after_return`` (Celery could not store the outcome):
    stop renewing its settle deadline, so that a redelivery completes the key once it passes,
    instead of an owner that is still alive holding it unsettled for ever."""
    request = getattr(task, "request", None)
    handle = getattr(request, "lease", None)
    if isinstance(handle, Execution) and handle.phase is Phase.SETTLING:
        Heartbeat.for_process().unwatch(handle)
        logger.warning("lease %s token %s: Celery did not store the outcome; a redelivery "
                       "completes it after the settle deadline", handle.key, handle.token)


def install() -> None:
    """Stop renewing an outcome Celery did not store, after each task (wiring)."""
    celery_signals.task_postrun.connect(_stop_renewing_unconfirmed, weak=False,
                                        dispatch_uid="lease_celery.execution.settle.task_postrun")
