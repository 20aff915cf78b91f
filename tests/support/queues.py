"""Real Celery apps publishing to a Redis queue of a test's own, and what the queue holds.

For tests of what lease_celery publishes (the sweeper, an operator's requeue) without a
worker: the message kombu's Redis transport wrote is read back from the queue's lists.
"""

from __future__ import annotations

import base64
import json
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import redis
from celery import Celery

from tests.support.servers import REDIS_URL

#: A broker nobody listens on (the discard port): publishing there fails at once.
DOWN_BROKER = "redis://127.0.0.1:9/0"


def publishing_app(queue: str, *, broker: str = REDIS_URL) -> Celery:
    """A Celery app publishing by name to ``queue``; on ``DOWN_BROKER`` a publish raises at
    once (no connection retries)."""
    app = Celery("lease-tests-publisher", broker=broker, set_as_current=False)
    app.conf.update(task_default_queue=queue, task_publish_retry=False,
                    broker_connection_retry=False, broker_connection_timeout=1,
                    broker_transport_options={"max_retries": 0})  # kombu's own: 2 s else
    return app


@contextmanager
def own_queue() -> Iterator[str]:
    """A queue name of the test's own; its lists are deleted afterwards."""
    name = f"lease-tests-published-{uuid.uuid4().hex[:8]}"
    try:
        yield name
    finally:
        client = redis.Redis.from_url(REDIS_URL)
        for key in client.scan_iter(match=f"{name}*"):
            client.delete(key)


def published(queue: str) -> list[dict[str, Any]]:
    """The task messages waiting in ``queue`` (every priority list, the first list first),
    oldest first in each: task name, id, args, kwargs, retries, priority, the priority list
    (``""`` for the first, else its step) and the message's headers."""
    client = redis.Redis.from_url(REDIS_URL)
    found = []
    for key in sorted(client.scan_iter(match=f"{queue}*")):
        for raw in reversed(client.lrange(key, 0, -1)):  # LPUSH: the oldest is last
            message = json.loads(raw)
            args, kwargs, _ = json.loads(base64.b64decode(message["body"]))
            headers = message["headers"]
            found.append({"task": headers["task"], "id": headers["id"], "args": args,
                          "kwargs": kwargs, "retries": headers.get("retries"),
                          "priority": message["properties"].get("priority"),
                          # kombu's list: the queue's name, then <queue>\x06\x16<step>
                          "list": key.decode().removeprefix(queue).replace("\x06\x16", ""),
                          "headers": headers})
    return found
