"""Enqueue in the caller's transaction: the key's row is the message's outbox.

``task.apply_async(args, lease_transaction=conn)`` writes the key's row, ``ready`` with the
message's task info, in ``conn``'s open transaction (``Store.record_published_in``), and holds
the message back. A rollback leaves no row, and the message is never sent. After the commit
the message is published: by ``publish_committed(conn)``, by ``transaction(conn)`` as it
commits, on a SQLAlchemy ``Session``'s commit by itself, or by another integration's commit
hook (Django's ``on_commit``).

A commit whose publish never happened (the process died right after it, the broker was down)
still has its row: nobody claims it, so the sweeper publishes it from the row once it is
``lease_sweep_grace`` past due, as any ready row (``worker/sweeper.py``). A publish that came
late after all meets the lease, which answers or drops the second copy.

The held messages are checked against the store before they go: one whose row is not there
(its transaction rolled back) is dropped, so a connection's rolled-back enqueues never run
even if the app calls ``publish_committed`` after a rollback.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import uuid
import weakref
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from ..app_connections import AppConnection, app_connection
from ..errors import ConfigError
from ..keys import message_key
from ..stores.registry import shared_store
from .published import countdown_of, published_info
from .unique import existing_holder

__all__ = ["enqueue", "publish_committed", "transaction"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class _Held:
    """One message held back until its transaction commits."""

    task: Any
    args: Sequence[Any] | None
    kwargs: Mapping[str, Any] | None
    task_id: str
    options: Mapping[str, Any]
    #: The row written for it (None: the key had a row, so the message has none of its own).
    key: str | None


class _Outboxes:
    """The held messages of each app connection: weakly where the connection allows it (one
    that goes away takes its messages along; their rows are the sweeper's), else by identity
    until they are taken (``sqlite3`` connections: ``transaction`` and ``publish_committed``
    take them)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._weak: weakref.WeakKeyDictionary[Any, list[_Held]] = weakref.WeakKeyDictionary()
        self._strong: dict[int, tuple[Any, list[_Held]]] = {}

    def hold(self, conn: AppConnection, held: _Held) -> None:
        self._give(conn, [held], first=False)

    def held_for(self, conn: AppConnection, key: str) -> _Held | None:
        """The message this connection holds with ``key``'s row, if any."""
        with self._lock:
            try:
                messages = self._weak.get(conn.raw, [])
            except TypeError:
                messages = self._strong.get(id(conn.raw), (None, []))[1]
            return next((held for held in messages if held.key == key), None)

    def take(self, conn: AppConnection) -> list[_Held]:
        with self._lock:
            try:
                return self._weak.pop(conn.raw, [])
            except TypeError:  # not weakly referable
                return self._strong.pop(id(conn.raw), (None, []))[1]

    def give_back(self, conn: AppConnection, held: list[_Held]) -> None:
        if held:
            self._give(conn, held, first=True)

    def _give(self, conn: AppConnection, held: list[_Held], *, first: bool) -> None:
        with self._lock:
            try:
                messages = self._weak.setdefault(conn.raw, [])
            except TypeError:
                messages = self._strong.setdefault(id(conn.raw), (conn.raw, []))[1]
            if first:
                messages[:0] = held
            else:
                messages.extend(held)


_OUTBOXES = _Outboxes()


def enqueue(task: Any, connection: Any, args: Sequence[Any] | None,
            kwargs: Mapping[str, Any] | None, task_id: str | None,
            options: Mapping[str, Any], *, unique: bool) -> Any:
    """``apply_async(..., lease_transaction=connection)``: the row in the caller's
    transaction, the message held until it commits; the message's ``AsyncResult`` (with
    ``unique``, that of a holder the key already has, and nothing is held)."""
    conn = app_connection(connection)
    if not (conn.in_transaction or conn.opens_on_write):
        raise ConfigError(
            f"{task.name}: lease_transaction= needs a transaction to join, and this "
            "connection commits each statement (autocommit): open one first (for example "
            "with lease_celery.transaction(conn))")
    _watch_sqlalchemy_session(conn)
    task_id = task_id or uuid.uuid4().hex
    key = message_key(task, args, kwargs, task_id)
    store = shared_store(task.lease_settings.store_url)
    written = store.record_published_in(
        conn, key, task=published_info(task, args, kwargs, task_id, options),
        countdown=countdown_of(task.app, options))
    if not written and unique:
        # The key's row is this very transaction's (not committed, so the store's own
        # connection cannot see it), or another's.
        mine = _OUTBOXES.held_for(conn, key)
        holder = (task.AsyncResult(mine.task_id) if mine is not None
                  else existing_holder(task, args, kwargs, task_id))
        if holder is not None:
            return holder
    _OUTBOXES.hold(conn, _Held(task, args, kwargs, task_id, dict(options),
                               key if written else None))
    return task.AsyncResult(task_id)


def publish_committed(connection: Any) -> int:
    """Publish the messages ``connection``'s committed transactions enqueued; how many went.

    Call it after the commit. A message whose row is not in the store is dropped when the
    connection has no transaction open (it rolled back), and kept while one is (it may yet
    commit). A publish that fails is logged and left to the sweeper: the commit stands.
    """
    conn = app_connection(connection)
    held = _OUTBOXES.take(conn)
    still_open = conn.in_transaction
    kept: list[_Held] = []
    published = 0
    for message in held:
        if message.key is not None and not _row_committed(message):
            if still_open:
                kept.append(message)
            else:
                logger.info("lease %s: task %s was enqueued in a transaction that rolled "
                            "back: not published", message.key, message.task_id)
            continue
        try:
            message.task.apply_async(message.args, message.kwargs, message.task_id,
                                     lease_record=False, lease_unique=False,
                                     **message.options)
        except Exception:
            logger.warning("task %s (lease %s) committed but its publish failed: the sweeper "
                           "publishes it from its row", message.task_id, message.key,
                           exc_info=True)
            continue
        published += 1
    _OUTBOXES.give_back(conn, kept)
    return published


@contextmanager
def transaction(connection: Any) -> Iterator[Any]:
    """A transaction on ``connection`` (or the one open on it) whose enqueued tasks are
    published once it commits; rolled back, they are dropped with it."""
    conn = app_connection(connection)
    owned = not conn.in_transaction
    if owned:
        conn.begin()
    try:
        yield connection
    except BaseException:
        if owned:
            conn.rollback()
            _OUTBOXES.take(conn)
        raise
    if owned:
        conn.commit()
        publish_committed(connection)


def _row_committed(message: _Held) -> bool:
    """Is the message's row in the store (read on the store's own connection, which sees
    committed rows only)?"""
    store = shared_store(message.task.lease_settings.store_url)
    record = store.get(message.key) if message.key is not None else None
    return record is not None and record.task_id == message.task_id


def _watch_sqlalchemy_session(conn: AppConnection) -> None:
    """A SQLAlchemy ``Session`` publishes its held messages as it commits, by itself."""
    import sys

    orm = sys.modules.get("sqlalchemy.orm")
    if orm is None or not isinstance(conn.raw, orm.Session):
        return
    from sqlalchemy import event

    session = conn.raw
    if not event.contains(session, "after_commit", _session_committed):
        event.listen(session, "after_commit", _session_committed)
        event.listen(session, "after_soft_rollback", _session_rolled_back)


def _session_committed(session: Any) -> None:
    publish_committed(session)


def _session_rolled_back(session: Any, previous_transaction: Any) -> None:
    if previous_transaction.parent is None:  # the outermost: the enqueues are gone
        _OUTBOXES.take(app_connection(session))
