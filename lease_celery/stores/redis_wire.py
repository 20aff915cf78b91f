"""Running the Redis store's scripts on connections of its own, without redis-py's command layers.

Every lease operation is one ``EVALSHA``. Through ``redis.Redis`` each call also pays for the
client's retry wrapper, the pool's lock, its health check of the socket on every checkout
(a ``poll`` syscall) and the command dispatch: about 35 µs a call measured here (redis-py 8,
hiredis), more than the round trip itself (about 20 µs on loopback). A task makes two such
calls. This caller keeps idle connections in a plain list (``pop``/``append`` are atomic), sends
the command and reads the reply on the connection itself.

What it keeps of redis-py: the connection class and its settings (from the store's URL: TLS,
password, timeouts), the hiredis reply parser, and the error types the store already handles.
What it drops does not apply here: the store retries a dropped connection itself, knowing a
re-sent write may already have run (``RedisStore._call``), so redis-py's retry is off anyway.
A connection is reused only after a complete reply; on any error it is closed, never reused,
so no half-read reply can be mistaken for the next call's.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import redis
from redis.commands.core import Script
from redis.exceptions import NoScriptError

__all__ = ["ScriptCaller"]


class ScriptCaller:
    """Runs registered scripts for one store (one per store object, shared by its threads)."""

    def __init__(self, pool: redis.ConnectionPool) -> None:
        self._pool = pool
        self._pid = os.getpid()
        self._idle: list[Any] = []

    def run(self, script: Script, keys: Sequence[str], args: Sequence[Any]) -> Any:
        """``EVALSHA`` of ``script``; loads it first if the server lost it (a restart, or
        ``SCRIPT FLUSH``). Raises redis-py's errors, as ``Script.__call__`` would."""
        if self._pid != os.getpid():
            # A forked child: the parent's sockets are the parent's (it may be using them).
            self._pid, self._idle = os.getpid(), []
        try:
            connection = self._idle.pop()
        except IndexError:
            connection = self._pool.connection_class(**self._pool.connection_kwargs)
        try:
            reply = _evalsha(connection, script, keys, args)
        except BaseException:
            connection.disconnect()
            raise
        self._idle.append(connection)
        return reply

    def close(self) -> None:
        idle, self._idle = self._idle, []
        for connection in idle:
            connection.disconnect()


def _evalsha(connection: Any, script: Script, keys: Sequence[str], args: Sequence[Any]) -> Any:
    try:
        connection.send_command("EVALSHA", script.sha, len(keys), *keys, *args)
        return connection.read_response()
    except NoScriptError:
        # The error reply was read whole: the connection is still in step.
        connection.send_command("SCRIPT", "LOAD", script.script)
        script.sha = connection.read_response()
        connection.send_command("EVALSHA", script.sha, len(keys), *keys, *args)
        return connection.read_response()
