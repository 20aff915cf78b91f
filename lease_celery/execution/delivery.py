"""What lease_celery needs to know about, and do with, a Celery delivery.

Recording a delivery on the lease row (so it can be re-published without its message: sweeper,
requeue) and re-publishing it (deferral of a duplicate, store outage, recovery). Whether a task
finished is never asked of the result backend (``rpc://`` answers PENDING inside a worker):
the lease row is the record (see ``settle``).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
from collections.abc import Callable, Mapping
from typing import Any

from celery.exceptions import Reject
from celery.utils.dispatch import Signal

from .recovery import first_priority, recovery_options

__all__ = ["CONTEXT", "CONTEXT_HEADER", "NOWHERE", "body_signature", "delivery_context",
           "republish", "republish_later", "task_info"]

logger = logging.getLogger(__name__)

#: Sent before a delivery is re-published, with ``headers``: those of the delivery it
#: re-publishes (as received, or as recorded on the lease row). Each receiver answers with
#: headers the copy carries besides them. ``lease_celery.otel`` connects one: the new run's
#: span then links to that delivery's. (Celery's ``Signal.send`` logs a receiver's exception:
#: a re-publish never fails for one.)
republish_headers = Signal(name="lease_republish_headers")


def _headers_added(headers: Mapping[str, Any]) -> dict[str, Any]:
    """What ``republish_headers`` receivers add to a re-publish's headers."""
    added: dict[str, Any] = {}
    for _, answer in republish_headers.send(sender=None, headers=headers):
        if isinstance(answer, Mapping):
            added.update(answer)
    return added


def _prepared(app: Any, signature: Any, *, recovery: bool) -> Any:
    """``signature`` (a re-publish of a delivery) with the priority and headers it goes with.

    Recovered work takes the recovery priority (``recovery``); any other re-publish (the
    deferral of a duplicate) goes back at the priority its work was first published with, so a
    duplicate of recovered work does not jump the queue too. Headers unchanged with no
    ``republish_headers`` receiver and no priority to note."""
    options = signature.options
    headers = dict(options.get("headers") or {})
    if recovery:
        extra = recovery_options(app, signature)
        if extra:
            options["priority"] = extra["priority"]
            headers = extra["headers"]
    else:
        recovered, first = first_priority(headers)
        if recovered and first is None:
            options.pop("priority", None)  # the task's own default applies again
        elif recovered:
            options["priority"] = first
    if republish_headers.receivers:
        headers.update(_headers_added(headers))
    if headers or options.get("headers") is not None:
        options["headers"] = headers
    return signature


#: The task info's field naming the delivery's canvas context (``delivery_context``); a
#: settled done row keeps it beside the task id.
CONTEXT = "context"
#: The context of a delivery that nothing follows (no callbacks, errbacks, chain or chord).
NOWHERE = "-"
#: Header of a replacement: the context of the delivery it replaces, which it keeps.
CONTEXT_HEADER = "lease_context"
#: The options that place a delivery in its canvas: where its outcome goes (callbacks,
#: errbacks, the rest of its chain, the chord it counts towards, its place in a group). A
#: broker's redelivery, a deferral and a retry keep all of them; the same frozen signature
#: applied in another chain or chord changes at least one. Not what Celery mints anew each time
#: it sends the same callbacks (the parent and root ids, and the id of the group it makes of
#: several callbacks): a callback with a fixed id sent again goes to the same place, and is
#: the same callback.
_PLACE = ("group_index", "chord", "chain", "link", "link_error")


def delivery_context(options: Mapping[str, Any], inherited: Any = None) -> str:
    """A digest of where a delivery's outcome goes (``options``: its execution options).

    Two deliveries of one task id with the same context are copies of one message: the second
    of a done key is dropped, or Celery would send its callbacks twice. With another context
    the id was applied again elsewhere (a frozen signature in a second canvas): that place
    is answered with the key's outcome. A replacement keeps the context of the delivery it
    replaces (``CONTEXT_HEADER``, read by the worker as the request's ``inherited``, or among
    the ``headers`` of a recorded copy): Celery sends the same callbacks from it."""
    headers = options.get("headers")
    if inherited is None and isinstance(headers, Mapping):
        inherited = headers.get(CONTEXT_HEADER)
    if isinstance(inherited, str):
        return inherited
    place = {name: options.get(name) for name in _PLACE}
    if all(value is None or value == [] for value in place.values()):
        return NOWHERE  # most deliveries: nothing follows them, and no digest to pay for
    text = json.dumps(place, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def task_info(task: Any, request: Any, args: Any, kwargs: Any) -> dict[str, Any]:
    """The delivery as a signature (task, args, kwargs, id, routing, links) for the lease row,
    with its ``CONTEXT``.

    The store keeps it as kombu JSON, or nothing when the arguments cannot be encoded (then
    only the broker can redeliver the task).
    """
    signature = dict(task.signature_from_request(request, args, kwargs))
    options = {k: v for k, v in signature.get("options", {}).items() if v is not None}
    inherited = getattr(request, CONTEXT_HEADER, None)
    if isinstance(inherited, str):  # a replacement: its copies keep the context too
        options["headers"] = {**(options.get("headers") or {}), CONTEXT_HEADER: inherited}
    signature["options"] = options
    signature[CONTEXT] = delivery_context(options, inherited)
    return signature


def republish_later(task: Any, args: Any, kwargs: Any, countdown: float, *,
                    recovery: bool = False) -> None:
    """Publish the current delivery again (same id, arguments, links) to run in ``countdown``:
    as recovered work (``recovery``: its lease lapsed, its store did not answer), or at the
    priority its work was first published with (a duplicate of a live key waits its turn).

    No "expires" on the copy: it shares the task id with the live (or finished) run, and
    Celery would mark that id REVOKED when an expired copy arrives. When the broker cannot take
    it, the delivery is handed back (``Reject(requeue=True)``) rather than acked and lost.
    """
    request = task.request
    try:
        copy = task.signature_from_request(request, args, kwargs, countdown=countdown,
                                           expires=None)
        # The copy is published from inside this task, so Celery makes this task its parent:
        # it carries its context instead, or it would be a delivery from another place.
        _keep_context(copy, delivery_context(copy.options,
                                             getattr(request, CONTEXT_HEADER, None)))
        # lease_unique=False: this delivery must arrive, even though its key has a holder;
        # lease_record=False: its row exists.
        _prepared(task.app, copy, recovery=recovery).apply_async(lease_unique=False,
                                                                 lease_record=False)
    except Exception as exc:
        logger.warning("delivery %s could not be deferred (%r): requeued", request.id, exc)
        raise Reject(exc, requeue=True) from exc


def republish(app: Any, info: Mapping[str, Any], *, recovery: bool = False,
              **options: Any) -> Any:
    """Publish the recorded delivery again (same task id, arguments, routing and links); as
    recovered work ahead of new work with ``recovery`` (see ``recovery``)."""
    fields = {name: value for name, value in info.items() if name != CONTEXT}
    copy = app.signature({**fields, "options": dict(info.get("options") or {})})
    _keep_context(copy, info.get(CONTEXT))
    return _prepared(app, copy, recovery=recovery).apply_async(
        lease_unique=False, lease_record=False, **options)


def _keep_context(copy: Any, context: Any) -> None:
    """Have ``copy`` of a delivery keep that delivery's ``context`` (``CONTEXT_HEADER``):
    a copy comes from the same place as the delivery it copies, whoever publishes it."""
    if isinstance(context, str):
        copy.options["headers"] = {**(copy.options.get("headers") or {}), CONTEXT_HEADER: context}


def body_signature(cls: type) -> Callable[..., Any] | None:
    """The callable whose parameters a delivery's arguments bind to, or None if not defined.

    ``@app.task(bind=True)`` stores the function itself as ``run`` (first parameter: the task);
    without ``bind`` it stores a ``staticmethod``; a subclass may define ``def run(self, ...)``.
    """
    run = cls.__dict__.get("run")
    if run is None:
        return None
    if isinstance(run, staticmethod):
        return run.__func__
    return functools.partial(run, None)
