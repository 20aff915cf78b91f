"""What lease_celery needs to know about, and do with, a Celery delivery.

Recording a delivery on the lease row (so it can be re-published without its message: sweeper,
requeue) and re-publishing it (deferral of a duplicate, store outage, recovery). Whether a task
finished is never asked of the result backend (``rpc://`` answers PENDING inside a worker):
the lease row is the record (see ``settle``).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping
from typing import Any

from celery.exceptions import Reject
from celery.utils.dispatch import Signal

__all__ = ["body_signature", "republish", "republish_later", "task_info"]

logger = logging.getLogger(__name__)

#: Sent before a delivery is re-published, with ``headers``: those of the delivery it
#: re-publishes (as received, or as recorded on the lease row). Each receiver answers with
#: headers the copy carries besides them. ``lease_celery.otel`` connects one: the new run's
#: span then links to that delivery's. (Celery's ``Signal.send`` logs a receiver's exception:
#: a re-publish never fails for one.)
republish_headers = Signal(name="lease_republish_headers")


def _republished(headers: Mapping[str, Any] | None) -> dict[str, Any]:
    """The ``headers`` option of a re-publish: none (unchanged) with no receiver."""
    if not republish_headers.receivers:
        return {}
    added: dict[str, Any] = {}
    for _, answer in republish_headers.send(sender=None, headers=headers):
        if isinstance(answer, Mapping):
            added.update(answer)
    return {"headers": {**(headers or {}), **added}}


def task_info(task: Any, request: Any, args: Any, kwargs: Any) -> dict[str, Any]:
    """The delivery as a signature (task, args, kwargs, id, routing, links) for the lease row.

    The store keeps it as kombu JSON, or nothing when the arguments cannot be encoded (then
    only the broker can redeliver the task).
    """
    signature = dict(task.signature_from_request(request, args, kwargs))
    options = {k: v for k, v in signature.get("options", {}).items() if v is not None}
    signature["options"] = options
    return signature


def republish_later(task: Any, args: Any, kwargs: Any, countdown: float) -> None:
    """Publish the current delivery again (same id, arguments, links) to run in ``countdown``.

    No "expires" on the copy: it shares the task id with the live (or finished) run, and
    Celery would mark that id REVOKED when an expired copy arrives. When the broker cannot take
    it, the delivery is handed back (``Reject(requeue=True)``) rather than acked and lost.
    """
    request = task.request
    try:
        # lease_unique=False: this delivery must arrive, even though its key has a holder;
        # lease_record=False: its row exists.
        task.signature_from_request(request, args, kwargs, countdown=countdown, expires=None,
                                    **_republished(request.headers)
                                    ).apply_async(lease_unique=False, lease_record=False)
    except Exception as exc:
        logger.warning("delivery %s could not be deferred (%r): requeued", request.id, exc)
        raise Reject(exc, requeue=True) from exc


def republish(app: Any, info: Mapping[str, Any], **options: Any) -> Any:
    """Publish the recorded delivery again (same task id, arguments, routing and links)."""
    recorded = (info.get("options") or {}).get("headers")
    return app.signature(dict(info)).apply_async(
        lease_unique=False, lease_record=False, **{**_republished(recorded), **options})


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
