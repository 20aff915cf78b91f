"""The run's broker, Redis, RabbitMQ or SQS: its URL, what it still holds, its cleanup.

- ``redis``: database 15 of the machine's Redis; every key of the run (queue, unacked index)
  under the run's ``global_keyprefix``, deleted after.
- ``rabbitmq``: the machine's RabbitMQ (``guest`` on ``/``); the run's queue and exchange
  (``chaos-<run>``, both named after Celery's default queue) are its own, deleted after. A
  worker's unacked messages go back to the queue when its connection drops (a kill), so
  nothing is ever held by a dead worker.
- ``sqs``: a moto SQS server on a loopback port (``LEASE_TEST_SQS_PORT``, or one the harness
  starts: benchmarks/sqs_server.py); the run's queue ``chaos-<run>``, deleted after. A message
  not deleted within the visibility timeout (``--visibility-timeout``) comes back by itself.

The result backend and the event log live in Redis database 15 with either broker.
"""

from __future__ import annotations

import base64
import contextlib
import json
from dataclasses import dataclass
from typing import Any

from .. import sqs_server
from .history import BrokerMessage
from .sandbox import BROKER_DB, REDIS_HOST, REDIS_PORT, delete_keys, redis_client

__all__ = ["BROKERS", "RABBITMQ_URL", "BrokerSandbox"]

BROKERS = ("redis", "rabbitmq", "sqs")
RABBITMQ_URL = "amqp://guest:guest@127.0.0.1:5672//"


@dataclass(frozen=True)
class BrokerSandbox:
    kind: str  # one of BROKERS
    keyprefix: str  # the run's prefix of every Redis key (broker, results, events)
    queue: str
    sqs_port: int | None = None  # the SQS server's (sqs)

    @classmethod
    def of(cls, kind: str, keyprefix: str, queue: str) -> BrokerSandbox:
        """The run's broker; for SQS, a server that answers (started if none was given)."""
        port = None
        if kind == "sqs":
            port, why = sqs_server.sqs_port()
            if port is None:
                raise RuntimeError(f"no SQS server: {why}")
        return cls(kind, keyprefix, queue, port)

    @property
    def url(self) -> str:
        if self.kind == "sqs":
            return sqs_server.broker_url(int(self.sqs_port or 0))
        return RABBITMQ_URL if self.kind == "rabbitmq" else backend_url()

    def check(self) -> None:
        """Raise if the broker does not answer."""
        if self.kind == "sqs":
            self._sqs().list_queues()
        elif self.kind == "rabbitmq":
            from kombu import Connection

            with Connection(self.url, connect_timeout=5) as conn:
                conn.ensure_connection(max_retries=1)
        else:
            redis_client(BROKER_DB).ping()

    def queued(self) -> int:
        """Messages ready in the run's queue (not those a worker holds)."""
        if self.kind == "sqs":
            return self._sqs_counts().get("ApproximateNumberOfMessages", 0)
        if self.kind == "rabbitmq":
            return _rabbitmq_count(self.url, self.queue)
        client = redis_client(BROKER_DB)
        return sum(int(client.llen(key)) for key in
                   client.scan_iter(match=f"{self.keyprefix}{self.queue}*", count=1000)
                   if client.type(key) in (b"list", "list"))

    def purge(self) -> int:
        """Delete every message ready in the run's queue (each priority list), not those a
        worker holds; how many went. Redis only: the ``purge`` fault."""
        if self.kind != "redis":
            raise ValueError(f"purge is a fault of the Redis broker, not of {self.kind}")
        client = redis_client(BROKER_DB)
        purged = 0
        for key in client.scan_iter(match=f"{self.keyprefix}{self.queue}*", count=1000):
            if client.type(key) in (b"list", "list"):
                # LLEN then DEL in one transaction: the count is what the delete removed.
                with client.pipeline() as pipe:
                    pipe.llen(key)
                    pipe.delete(key)
                    length, _ = pipe.execute()
                purged += int(length)
        return purged

    def messages(self) -> list[BrokerMessage]:
        """Task messages the broker still holds once every worker has stopped."""
        if self.kind == "sqs":
            return self._sqs_messages()
        if self.kind == "rabbitmq":
            return _rabbitmq_messages(self.url, self.queue)
        return _redis_messages(self.keyprefix, self.queue)

    def cleanup(self) -> None:
        if self.kind == "sqs":
            with contextlib.suppress(Exception):
                client = self._sqs()
                for url in self._sqs_urls():
                    client.delete_queue(QueueUrl=url)
        if self.kind == "rabbitmq":
            from kombu import Connection

            with Connection(self.url, connect_timeout=5) as conn:
                channel = conn.channel()
                for delete in (channel.queue_delete, channel.exchange_delete):
                    with contextlib.suppress(Exception):
                        delete(self.queue)
        delete_keys(BROKER_DB, self.keyprefix)


    # -- SQS -----------------------------------------------------------------------------------

    def _sqs(self) -> Any:
        return sqs_server.sqs_client(int(self.sqs_port or 0))

    def _sqs_urls(self) -> list[str]:
        found = self._sqs().list_queues(QueueNamePrefix=self.queue).get("QueueUrls", [])
        return [str(url) for url in found]

    def _sqs_counts(self) -> dict[str, int]:
        totals: dict[str, int] = {}
        for url in self._sqs_urls():
            attributes = self._sqs().get_queue_attributes(
                QueueUrl=url, AttributeNames=["All"])["Attributes"]
            for name, value in attributes.items():
                if name.startswith("ApproximateNumberOfMessages"):
                    totals[name] = totals.get(name, 0) + int(value)
        return totals

    def _sqs_messages(self) -> list[BrokerMessage]:
        """Every message still in the queue, visible or not yet: each read once, hidden for a
        minute while the rest are read (the queue is deleted after)."""
        client, found = self._sqs(), []
        for url in self._sqs_urls():
            while messages := client.receive_message(
                    QueueUrl=url, MaxNumberOfMessages=10, VisibilityTimeout=60,
                    WaitTimeSeconds=0).get("Messages", []):
                for message in messages:
                    payload = json.loads(base64.b64decode(message["Body"]))
                    found.append(_message(payload, "queue"))
        return found


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
