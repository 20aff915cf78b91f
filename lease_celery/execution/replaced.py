"""``replace()``: which key the replacement runs on, and the message the row hands it.

Celery gives the replacement this task's id: the replacing signature itself, the last task of
a replacing chain, or the body of the chord a replacing group becomes. When that signature is
a LeasedTask whose key is this execution's key (always so for tasks keyed by their id), the key
is the replacement's to claim: it is handed on before the replacement is published, with the
replacement's message on the row (what a sweeper re-publishes if the message is lost).
Otherwise the replacement runs on no lease of this key, and the key's own work is over.

The heir keeps the replaced delivery's context (``delivery.CONTEXT_HEADER``): Celery sends the
replaced task's callbacks from it, so a late copy of either message is the same place's and is
dropped once the key is done, not answered a second time.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from typing import Any

from celery.canvas import Signature, maybe_signature

from ..apps import is_leased
from ..keys import resolve_key
from .delivery import CONTEXT_HEADER, delivery_context

__all__ = ["replacement_message"]

logger = logging.getLogger(__name__)


def replacement_message(task: Any, key: str, replacement: Any) -> dict[str, Any] | None:
    """The replacement as the lease row records a delivery, if it claims ``key`` next (the
    signature inheriting ``task``'s id is a LeasedTask whose arguments give ``key``); None
    when it does not."""
    task_id = task.request.id
    for signature in _signatures(task.app, replacement):
        if signature.options.get("task_id") != task_id:
            continue
        heir = task.app.tasks.get(signature.task)
        if heir is None or not is_leased(heir):
            return None
        try:
            heir_key = resolve_key(heir.lease_key, heir.run, tuple(signature.args or ()),
                                   dict(signature.kwargs or {}), task_id=task_id)
        except Exception:  # arguments that give no key: the heir will say so itself
            logger.debug("lease %s: the replacement's key could not be resolved", key,
                         exc_info=True)
            return None
        if heir_key != key:
            return None
        context = delivery_context(task.request.as_execution_options(),
                                   getattr(task.request, CONTEXT_HEADER, None))
        signature.options["headers"] = {**(signature.options.get("headers") or {}),
                                        CONTEXT_HEADER: context}
        return dict(replacement)
    return None


def _signatures(app: Any, signature: Any) -> Iterator[Signature]:
    """Every task signature in ``signature``: itself, or the members of a chain, group or
    chord (a chord's body last)."""
    signature = maybe_signature(signature, app=app)
    if signature is None:
        return
    members = signature.get("subtask_type")
    if members in ("chain", "group", "chord"):
        kwargs: Mapping[str, Any] = signature.kwargs or {}
        for member in kwargs.get("tasks") or ():
            yield from _signatures(app, member)
        if members == "chord" and kwargs.get("body") is not None:
            yield from _signatures(app, kwargs["body"])
        return
    yield signature
