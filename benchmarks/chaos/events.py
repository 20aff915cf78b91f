"""The event log: one Redis list that worker processes and the harness append JSON events to.

Each event carries ``event`` (its kind), ``pid`` and ``t`` (epoch seconds; every process runs
on this machine, so one clock orders them). The log lives in the broker's Redis database under
the run's key prefix and is never faulted: connection kills target the lease store only.

An event is appended with one ``RPUSH`` before the step it describes continues, so a process
killed right after a step can leave that step unrecorded: the checker can miss a violation that
way, never invent one.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

import redis

__all__ = ["Event", "EventLog"]

Event = dict[str, Any]


class EventLog:
    """Append and read the events of one run (a client per process, made after fork)."""

    def __init__(self, redis_url: str, key: str) -> None:
        self.redis_url, self.key = redis_url, key
        self._client: redis.Redis | None = None
        self._pid = 0
        self._lock = threading.Lock()

    def _redis(self) -> redis.Redis:
        with self._lock:
            if self._client is None or self._pid != os.getpid():
                self._client = redis.Redis.from_url(self.redis_url, socket_timeout=10,
                                                    socket_connect_timeout=5)
                self._pid = os.getpid()
            return self._client

    def record(self, event: str, **fields: Any) -> None:
        entry = {"event": event, "pid": os.getpid(), "t": time.time(), **fields}
        self._redis().rpush(self.key, json.dumps(entry, default=str, sort_keys=True))

    def length(self) -> int:
        return int(self._redis().llen(self.key))

    def read(self, start: int = 0) -> list[Event]:
        """Every event from position ``start`` on, oldest first."""
        raw: list[bytes | str] = self._redis().lrange(self.key, start, -1)
        return [json.loads(item) for item in raw]
