"""The end of ``chaos.job`` in the ``app-tx`` and ``enqueue-tx`` variants: the app row and the
key's finish in one transaction of the app's own connection (``self.lease.transaction``).

And the ``commit_exit`` fault: right after that transaction committed, while a ticket is
armed, the pool process ``os._exit``\\ s: the key is done in the store, Celery has neither
stored the result nor acked the message. The redelivery must be answered from the row (the
body never runs again, no second app row).

Jobs of even number use the driver's connection (``sqlite3``, psycopg 3), odd ones a
SQLAlchemy ``Connection``: one of each per pool process. A connection the ``conn`` fault (or
a restart) broke is replaced and the transaction run again, as an app would: its rows rolled
back with it. A commit whose outcome is unknown is
run again too; if it did commit, the retry's lock finds the key done and raises
``LeaseLost``, and what the library makes of that is what the run checks.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import time
from collections.abc import Callable
from typing import Any

from .appdb import AppDatabase
from .calls import commit_known
from .events import EventLog
from .flags import Flags

__all__ = ["commit_retrying", "complete_in_app"]

#: Tries of the transaction on a broken connection before the body gives up (the failure is
#: then the task's, and the checker's ``unexplained_dead`` judges it).
ATTEMPTS = 40
#: Seconds between tries: a PostgreSQL restart takes a second or two.
PAUSE = 0.25

#: This pool process's app connections by kind (``driver``, ``sqlalchemy``), made on first use.
_connections: dict[str, Any] = {}
_engines: dict[str, Any] = {}


def _connection_errors() -> tuple[type[BaseException], ...]:
    """What a broken connection raises, through the driver or through SQLAlchemy."""
    import psycopg
    from sqlalchemy import exc

    return (sqlite3.OperationalError, psycopg.OperationalError, psycopg.InterfaceError,
            exc.OperationalError, exc.InterfaceError, exc.PendingRollbackError)


def _kind(job: str) -> str:
    return "sqlalchemy" if int(job.lstrip("j")) % 2 else "driver"


def _connect(db: AppDatabase, kind: str) -> Any:
    if kind not in _connections:
        if kind == "driver":
            _connections[kind] = db.connect()
        else:
            engine = _engines.setdefault(db.target, db.engine())
            _connections[kind] = engine.connect()
    return _connections[kind]


def _drop(kind: str) -> None:
    conn = _connections.pop(kind, None)
    if conn is not None:
        with contextlib.suppress(Exception):
            conn.close()


def complete_in_app(task: Any, db: AppDatabase, job: str, result: dict[str, Any], *,
                    events: EventLog, flags: Flags) -> dict[str, Any]:
    """Insert the job's app row and complete the key with ``result`` in one transaction."""
    lease, kind = task.lease, _kind(job)

    def commit() -> None:
        conn = _connect(db, kind)
        with lease.transaction(conn) as tx:
            db.insert_app_row(conn, job, lease.token, os.getpid(), task.request.id)
            tx.complete(result)

    commit_retrying(task, commit, errors=_connection_errors(), drop=lambda: _drop(kind),
                    connection=kind, events=events, flags=flags)
    return result


def commit_retrying(task: Any, commit: Callable[[], None], *,
                    errors: tuple[type[BaseException], ...], drop: Callable[[], None],
                    connection: str, events: EventLog, flags: Flags) -> None:
    """Run ``commit`` (the app's writes and ``tx.complete`` in one transaction) until it
    commits: a broken connection (``errors``) is dropped and the transaction run again, up to
    ``ATTEMPTS`` times. Then the ``commit_exit`` fault, if a ticket is armed. Shared by every
    transactional body (the driver's and SQLAlchemy's connections here, Django's ORM in
    :mod:`.djangotx`): the model's judge, the retry events and the fault stay one."""
    lease, task_id = task.lease, task.request.id
    for attempt in range(1, ATTEMPTS + 1):
        lease.check()  # a lease lost meanwhile: stop here, nothing of ours is committed
        try:
            commit()
        except errors as exc:
            commit_known(None)  # a finish accepted before the failure: its commit is unknown
            drop()
            events.record("app_tx_retry", task_id=task_id, key=lease.key, token=lease.token,
                          attempt=attempt, connection=connection, error=repr(exc)[:200])
            if attempt == ATTEMPTS:
                raise
            time.sleep(PAUSE)
            continue
        except BaseException:
            commit_known(None)
            raise
        commit_known(True)
        break
    events.record("app_row_committed", task_id=task_id, key=lease.key, token=lease.token,
                  connection=connection)
    if flags.take("commit_exit"):
        events.record("fault", kind="commit_exit", key=lease.key, task_id=task_id)
        os._exit(1)
