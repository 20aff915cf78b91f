"""What each broker does with the message of a worker that was SIGKILLed, and what it still holds.

The demo asks the broker itself instead of assuming: the filesystem transport's folder, Redis's
queue list and its ``unacked`` hash (where kombu keeps a delivered, unacked message until the
worker acks it or a restore sweep puts it back after ``visibility_timeout``).
"""

from __future__ import annotations

import json
import os
from typing import Any

__all__ = ["Broker"]

#: kombu's Redis default; the example's settings do not change it.
REDIS_VISIBILITY_TIMEOUT = 3600.0


class Broker:
    def __init__(self, url: str, app: Any) -> None:
        self.url, self.app = url, app
        self.kind = ("filesystem" if url.startswith("filesystem") else
                     "redis" if url.startswith(("redis", "rediss")) else
                     "rabbitmq" if url.startswith(("amqp", "pyamqp")) else "other")

    @property
    def visibility_timeout(self) -> float:
        options = self.app.conf.broker_transport_options or {}
        return float(options.get("visibility_timeout", REDIS_VISIBILITY_TIMEOUT))

    def on_kill(self) -> str:
        """What this broker does with a SIGKILLed worker's unacked message."""
        if self.kind == "filesystem":
            return ("filesystem transport: it deleted the message when the worker fetched it, so "
                    "it can never redeliver it")
        if self.kind == "redis":
            return (f"Redis: keeps the dead worker's message unacked and restores it only after "
                    f"visibility_timeout ({self.visibility_timeout:g}s) and a restore sweep: not "
                    "within this demo")
        if self.kind == "rabbitmq":
            return ("RabbitMQ: requeues a dead consumer's unacked message as soon as its "
                    "connection drops: expect a real redelivery")
        return "this broker's redelivery rules decide whether the killed delivery comes back"

    def later(self) -> str:
        """What the broker would still do with the killed message after the demo (leased run)."""
        if self.kind == "redis":
            return (f"Redis would also hand the killed message out again after "
                    f"visibility_timeout ({self.visibility_timeout:g}s) and a restore sweep")
        if self.kind == "rabbitmq":
            return "RabbitMQ requeued the killed message at once"
        return ("On Redis or RabbitMQ the broker would also give the killed message back "
                "(Redis after visibility_timeout, 1 h by default; RabbitMQ at once)")

    def holds(self, queue: str) -> str | None:
        """What the broker still holds of ``queue``, for people; None if it cannot tell."""
        try:
            if self.kind == "filesystem":
                folder = (self.app.conf.broker_transport_options or {}).get("data_folder_in")
                if not folder:
                    return None
                ready = sum(name.partition(".")[2] == f"{queue}.msg"
                            for name in os.listdir(folder))
                return f"its folder holds {ready} message(s) of the queue"
            if self.kind == "redis":
                with self.app.connection_for_read() as connection:
                    channel = connection.default_channel
                    ready = channel._size(queue)
                    unacked = len(_unacked_tags(channel, {queue}))
                return (f"Redis holds {ready} ready and {unacked} unacked message(s) of the queue"
                        + (" (the killed worker's, waiting for visibility_timeout)"
                           if unacked else ""))
        except Exception:  # a look, not a step of the story
            return None
        return None

    def forget_unacked(self, queues: list[str]) -> int:
        """Redis: remove the run's unacked messages that killed workers left behind.

        Otherwise a restore sweep would put them back after ``visibility_timeout`` and re-create
        the run's deleted queue, long after the demo. Other brokers keep nothing of the kind.
        """
        if self.kind != "redis":
            return 0
        with self.app.connection_for_write() as connection:
            channel = connection.default_channel
            tags = _unacked_tags(channel, set(queues))
            if tags:
                channel.client.hdel(channel.unacked_key, *tags)
                channel.client.zrem(channel.unacked_index_key, *tags)
        return len(tags)


def _unacked_tags(channel: Any, queues: set[str]) -> list[bytes]:
    """Delivery tags in kombu's ``unacked`` hash whose message was routed to one of ``queues``."""
    tags = []
    for tag, raw in channel.client.hscan_iter(channel.unacked_key):
        try:
            _message, exchange, routing_key = json.loads(raw)
        except (TypeError, ValueError):
            continue
        if routing_key in queues or exchange in queues:
            tags.append(tag)
    return tags
