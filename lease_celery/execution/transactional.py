"""The completion in the app's own transaction: the body's rows and the key's finish commit
together (``LeaseHandle.transaction``).

A finish written after the body's own commit leaves a window: a worker that dies between the
two leaves the app's rows committed on a key that is not done, and the next owner runs the
body again, its writes accepted under a new token. Written in the body's transaction, the
finish commits with those rows or not at all:

- on entry the lease is verified current under a lock on its row, in the app's transaction
  (``Store.lock_in``); no claim can take the key over until that transaction ends;
- on leaving, the finish and its history entry are written in it (``Store.finish_in``),
  fenced again: a lease no longer current rolls the whole transaction back with
  ``LeaseLost``;
- the verdict (the log line, the signals, the limit hand-on, settling) is said by the gate
  once the commit is known (``Gate``, ``Completion.finished``), as for a finish in line.
"""

from __future__ import annotations

import logging
from types import TracebackType
from typing import Any

from celery.result import ResultBase

from ..app_connections import AppConnection, app_connection
from ..runtime.execution import AppFinish, Execution, Phase
from ..stores.base import lease_not_current
from .ending import Ending, result_backend

__all__ = ["AppTransaction"]

logger = logging.getLogger(__name__)


class AppTransaction:
    """``with self.lease.transaction(conn) as tx:``: one execution's completion on ``conn``.

    ``tx.complete(value)`` names the key's result (None unless called) and returns it, so that
    ``return tx.complete(value)`` inside the block is the body's return too.
    """

    def __init__(self, task: Any, ending: Ending, execution: Execution,
                 connection: Any) -> None:
        self._task, self._ending, self._execution = task, ending, execution
        self.connection: AppConnection = app_connection(connection)
        self.result: Any = None
        self._owned = False  # did this block open the transaction (and so commit it)?

    def complete(self, result: Any) -> Any:
        """``result`` is the key's result, written with the finish when the block ends."""
        self.result = result
        return result

    def __enter__(self) -> AppTransaction:
        execution, conn = self._execution, self.connection
        if not conn.in_transaction:
            conn.begin()
            self._owned = True
        try:
            execution.store.lock_in(conn, execution.lease,
                                    when="when the transaction started")
        except BaseException:
            self._end(commit=False)
            raise
        execution.app_transaction_open(True)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        execution = self._execution
        execution.app_transaction_open(False)
        if exc_type is not None:
            self._end(commit=False)
            return
        stored = (result_backend(self._task).prepare_value(self.result)
                  if isinstance(self.result, ResultBase) else self.result)
        settle_within = self._ending.settle_within()
        # From here a renewal that comes back refused means nothing: the finish below is
        # fenced itself, and once it commits the row is done (a renewal held up by the row
        # lock is answered after the commit, refused).
        execution.enter(Phase.FINISHING)
        accepted = None
        try:
            accepted = execution.store.finish_in(self.connection, execution.lease, stored,
                                                 settle_within=settle_within)
            if not accepted:
                raise lease_not_current(execution.lease, "at commit", what="committed")
            self._end(commit=True)
        except BaseException as failed:
            if self.connection.in_transaction:
                self._end(commit=False)
            if accepted is False:
                execution.mark_lost(str(failed))
            else:
                execution.enter(Phase.RUNNING)  # nothing was written: the lease holds on
            raise
        execution.finish_written_in_app(AppFinish(stored, settle_within, self._owned))

    def _end(self, *, commit: bool) -> None:
        if not self._owned:
            return  # the app's own transaction: the app commits or rolls back
        self._owned = commit  # a rolled-back block committed nothing
        if commit:
            self.connection.commit()
        else:
            self.connection.rollback()
