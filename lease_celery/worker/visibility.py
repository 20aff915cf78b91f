"""``lease_extend_visibility``: a running task's message stays invisible while its lease lives.

SQS and kombu's Redis transport hand a message out again once it was not acked within the
visibility timeout, whether or not its worker still runs it. The lease already makes such a
copy harmless (it finds the key held and is deferred), but each copy costs a delivery, a
deferral and a re-publish, again every timeout for as long as the task runs. With this on, the
worker's main process extends the visibility of each running LeasedTask's message while the
task's lease is alive (its row running, or settling, under that task id and renewed:
``expires_at`` ahead of the store's clock), every quarter of the visibility timeout, in one
batch per tick:

- SQS: ``ChangeMessageVisibility`` of the message's receipt handle, to the timeout again;
- Redis: the message's score in kombu's unacked index (``ZADD XX``), to now.

When the owner dies or stalls its lease stops being renewed, its row expires, and the
extensions stop: the message comes back after one more timeout, as without this. Ownership
stays the lease's, judged by the store; only the timing of redelivery follows it.

It runs in the main process because the message is there: a prefork pool process gets the
task's arguments and headers, not the broker's receipt handle or delivery tag. It is a plain
thread with stores of its own, so under gevent or eventlet it is a greenlet on the hub, as the
broker channel whose sockets it uses must be; a body that never yields then delays the
extensions, and a copy that comes back meanwhile is deferred by the lease as without them.
SQS caps a message's visibility at 12 hours from its receipt: past that it is delivered again
anyway.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from ..apps import leased_tasks
from ..errors import LeaseError
from ..keys import message_key
from ..models import LeaseState
from ..stores.base import Store
from ..stores.registry import open_store

__all__ = ["VISIBILITY_DEFAULTS", "VisibilityExtender", "extending_tasks", "extension_tick",
           "visibility_timeout"]

logger = logging.getLogger(__name__)

#: kombu's default visibility timeouts (seconds), by broker URL scheme.
VISIBILITY_DEFAULTS = {"redis": 3600.0, "rediss": 3600.0, "sentinel": 3600.0, "sqs": 1800.0}
#: The shortest pause between two ticks (a tiny visibility timeout must not spin).
MIN_TICK = 0.2


def visibility_timeout(app: Any) -> float | None:
    """The broker's visibility timeout (seconds), or None for a broker without one."""
    from urllib.parse import urlsplit

    scheme = urlsplit(app.conf.broker_url or "amqp://").scheme.split("+")[0]
    if scheme not in VISIBILITY_DEFAULTS:
        return None
    options = app.conf.broker_transport_options or {}
    return float(options.get("visibility_timeout", VISIBILITY_DEFAULTS[scheme]))


def extension_tick(timeout: float) -> float:
    """Seconds between two extensions under a visibility timeout of ``timeout``: a quarter of
    it, so a message is extended well before it would be handed out again."""
    return max(MIN_TICK, timeout / 4)


def extending_tasks(app: Any) -> set[str]:
    """Names of the app's LeasedTasks with ``lease_extend_visibility`` on."""
    return {task.name for task in leased_tasks(app) if task.lease_settings.extend_visibility}


class VisibilityExtender(threading.Thread):
    """The worker main process's thread that extends running messages' visibility."""

    def __init__(self, app: Any, timeout: float, names: set[str]) -> None:
        super().__init__(name="lease-visibility", daemon=True)
        self.app, self.timeout, self.names = app, timeout, names
        self.tick = extension_tick(timeout)
        self.extended = 0  # messages extended, all ticks (for logs and tests)
        self._halt = threading.Event()
        self._stores: dict[str, Store] = {}

    def stop(self) -> None:
        self._halt.set()
        self.join(5)

    def run(self) -> None:
        try:
            while not self._halt.wait(self.tick):
                try:
                    self.extend_once()
                except Exception:  # one bad tick must not end the thread
                    logger.warning("lease visibility: a tick failed", exc_info=True)
        finally:
            for store in self._stores.values():
                store.close()

    def extend_once(self) -> int:
        """Extend the message of every running request whose lease is alive; how many."""
        from celery.worker.state import active_requests

        extended = 0
        for request in list(active_requests):
            if request.name not in self.names:
                continue
            try:
                if self._alive(request) and _extend(request.message, self.timeout):
                    extended += 1
            except Exception as exc:  # a message gone (acked meanwhile), a store error
                logger.debug("lease visibility: %s not extended: %r", request.id, exc)
        self.extended += extended
        return extended

    def _alive(self, request: Any) -> bool:
        """Whether the request's lease is held and renewed, as the store says."""
        task = self.app.tasks[request.name]
        key = message_key(task, request.args, request.kwargs, request.id)
        url = task.lease_settings.store_url
        store = self._stores.get(url) or self._stores.setdefault(url, open_store(url))
        try:
            record = store.get(key)
        except LeaseError:
            return False
        # Running, or settling (its outcome accepted, Celery not done with it): either way
        # renewed by a live owner while expires_at stays ahead of the store's clock.
        return (record is not None and record.task_id == request.id
                and (record.state is LeaseState.RUNNING or record.settling)
                and (record.expires_at or 0.0) > store.now())


def _extend(message: Any, timeout: float) -> bool:
    """Push back when the broker hands ``message`` out again; False for a transport this does
    not know."""
    info = message.delivery_info or {}
    channel = message.channel
    if "sqs_message" in info:
        queue = channel.canonical_queue_name(info["routing_key"]) if "routing_key" in info \
            else None
        channel.sqs(queue=queue).change_message_visibility(
            QueueUrl=info["sqs_queue"], ReceiptHandle=info["sqs_message"]["ReceiptHandle"],
            VisibilityTimeout=int(timeout))
        return True
    index = getattr(channel, "unacked_index_key", None)
    if index is not None and hasattr(channel, "conn_or_acquire"):
        with channel.conn_or_acquire() as client:
            client.zadd(index, {message.delivery_tag: time.time()}, xx=True)
        return True
    return False
