"""What lease_celery needs to know about, and do with, a Celery delivery.

Recording a delivery on the lease row (so it can be re-published without its message: sweeper,
requeue) and re-publishing it (deferral of a duplicate, store outage, recovery).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Mapping
from typing import Any

from .stores.base import Store, decode_task, encode_task, open_store

__all__ = ["body_signature", "republish", "shared_store", "task_info"]

_stores: dict[str, Store] = {}
_stores_lock = threading.Lock()


def shared_store(url: str) -> Store:
    """One store object per URL per process (the store itself reconnects after fork)."""
    with _stores_lock:
        store = _stores.get(url)
        if store is None:
            store = _stores[url] = open_store(url)
        return store


def task_info(task: Any, request: Any, args: Any, kwargs: Any) -> dict[str, Any] | None:
    """The delivery as a JSON signature (task, args, kwargs, id, routing, links), or None.

    ``None`` when the arguments cannot be encoded (then only the broker can redeliver it).
    """
    signature = dict(task.signature_from_request(request, args, kwargs))
    options = {k: v for k, v in signature.get("options", {}).items() if v is not None}
    signature["options"] = options
    text = encode_task(signature)  # what the store will hold; None if it cannot
    return None if text is None else decode_task(text)


def republish(app: Any, info: Mapping[str, Any], **options: Any) -> Any:
    """Publish the recorded delivery again (same task id, arguments, routing and links)."""
    return app.signature(dict(info)).apply_async(**options)


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
