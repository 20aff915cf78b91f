"""The run's broker, Redis or RabbitMQ: its URL and options, what it still holds, its cleanup.

- ``redis``: database 15 of the machine's Redis; every key of the run (queue, unacked index)
  under the run's ``global_keyprefix``, deleted after.
- ``rabbitmq``: the machine's RabbitMQ (``guest`` on ``/``); the run's queue and exchange
  (``chaos-<run>``, both named after Celery's default queue) are its own, deleted after. A
  worker's unacked messages go back to the queue when its connection drops (a kill), so
  nothing is ever held by a dead worker.

The result backend and the event log live in Redis database 15 with either broker.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from typing import Any

from .history import BrokerMessage
from .sandbox import BROKER_DB, REDIS_HOST, REDIS_PORT, delete_keys, redis_client

__all__ = ["BROKERS", "RABBITMQ_URL", "BrokerSandbox"]

BROKERS = ("redis", "rabbitmq")
RABBITMQ_URL = "amqp://guest:guest@127.0.0.1:5672//"


@dataclass(frozen=True)
class BrokerSandbox:
    kind: str  # one of BROKERS
    keyprefix: str  # the run's prefix of every Redis key (broker, results, events)
    queue: str

    @property
    def url(self) -> str:
        return RABBITMQ_URL if self.kind == "rabbitmq" else backend_url()

    def check(self) -> None:
        """Raise if the broker does not answer."""
        if self.kind == "rabbitmq":
            from kombu import Connection

            with Connection(self.url, connect_timeout=5) as conn:
                conn.ensure_connection(max_retries=1)
        else:
            redis_client(BROKER_DB).ping()

    def queued(self) -> int:
        """Messages ready in the run's queue (not those a worker holds)."""
        if self.kind == "rabbitmq":
            return _rabbitmq_count(self.url, self.queue)
        client = redis_client(BROKER_DB)
        return sum(int(client.llen(key)) for key in
                   client.scan_iter(match=f"{self.keyprefix}{self.queue}*", count=1000)
                   if client.type(key) in (b"list", "list"))

    def messages(self) -> list[BrokerMessage]:
        """Task messages the broker still holds once every worker has stopped."""
        if self.kind == "rabbitmq":
            return _rabbitmq_messages(self.url, self.queue)
        return _redis_messages(self.keyprefix, self.queue)

    def cleanup(self) -> None:
        if self.kind == "rabbitmq":
            from kombu import Connection

            with Connection(self.url, connect_timeout=5) as conn:
                channel = conn.channel()
                for delete in (channel.queue_delete, channel.exchange_delete):
                    with contextlib.suppress(Exception):
                        delete(self.queue)
        delete_keys(BROKER_DB, self.keyprefix)


def backend_url() -> str:
    """The Redis database of the result backend and the event log (and of a Redis broker)."""
    return f"redis://{REDIS_HOST}:{REDIS_PORT}/{BROKER_DB}"


def _rabbitmq_count(url: str, queue: str) -> int:
    from amqp.exceptions import NotFound
    from kombu import Connection

    with Connection(url, connect_timeout=5) as conn, conn.channel() as channel:
        try:
            return int(channel.queue_declare(queue=queue, passive=True).message_count)
        except NotFound:  # not declared yet
            return 0


def _rabbitmq_messages(url: str, queue: str) -> list[BrokerMessage]:
    """Read every message of the queue without taking it: none is acked, and closing the
    channel puts them all back."""
    from amqp.exceptions import NotFound
    from kombu import Connection

    found: list[BrokerMessage] = []
    with Connection(url, connect_timeout=5) as conn, conn.channel() as channel:
        try:
            while (message := channel.basic_get(queue, no_ack=False)) is not None:
                found.append(_message({"headers": message.headers}, "queue"))
        except NotFound:
            pass
    return found


def _redis_messages(keyprefix: str, queue: str) -> list[BrokerMessage]:
    """Task messages still in the run's queue (every priority list) and in kombu's unacked
    hash."""
    client = redis_client(BROKER_DB)
    messages: list[BrokerMessage] = []
    for raw in (client.hgetall(f"{keyprefix}unacked") or {}).values():
        payload = json.loads(raw)[0]  # [message, exchange, routing key]
        messages.append(_message(payload, "unacked"))
    for key in client.scan_iter(match=f"{keyprefix}{queue}*", count=1000):
        if client.type(key) in (b"list", "list"):
            for raw in client.lrange(key, 0, -1):
                messages.append(_message(json.loads(raw), "queue"))
    return messages


def _message(payload: dict[str, Any], where: str) -> BrokerMessage:
    headers = payload.get("headers") or {}
    return BrokerMessage(task_id=str(headers.get("id")), task=str(headers.get("task")),
                         parent_id=headers.get("parent_id"), root_id=headers.get("root_id"),
                         where=where)
