"""Django's connection as the app connection of issue 39's transactional completion and
outbox (``lease_celery.app_connections``): the ORM's writes and the lease's finish, or an
enqueued task's row, in one ``transaction.atomic()`` block.

:class:`DjangoConnection` runs the store's statements on this thread's Django connection for
an alias, inside the atomic block the caller (or ``lease.atomic()``) opened: Django owns the
transaction, commits it and rolls it back; lease_celery never begins or ends it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ...errors import ConfigError, LeaseError
from ...runtime.handle import LeaseHandle

__all__ = ["DjangoConnection", "DjangoLease", "alias_of"]

#: Django's vendor names, as the stores name their dialects.
_DIALECTS = {"postgresql": "postgres", "sqlite": "sqlite", "mysql": "mysql"}


def alias_of(store_url: str) -> str:
    """The database alias of a ``django://ALIAS`` store URL (Django's default alias for a
    store of another kind: the caller then has to name one)."""
    from django.db import DEFAULT_DB_ALIAS

    from .config import parse_url

    return parse_url(store_url)[0] if store_url.startswith("django://") else DEFAULT_DB_ALIAS


class DjangoConnection:
    """This thread's Django connection for ``alias``, in the store's terms (an
    ``AppConnection``). Used inside ``transaction.atomic(using=alias)`` only."""

    def __init__(self, alias: str) -> None:
        from django.db import connections

        self.alias = alias
        #: This thread's DatabaseWrapper: its identity keys the outbox of its transactions.
        self.raw = connections[alias]
        try:
            self.dialect = _DIALECTS[self.raw.vendor]
        except KeyError:
            raise ConfigError(f"Django database {alias!r} is {self.raw.vendor}: no lease store "
                              "runs on it") from None

    @property
    def in_transaction(self) -> bool:
        return bool(self.raw.in_atomic_block)

    @property
    def opens_on_write(self) -> bool:
        return False  # Django autocommits outside atomic()

    def _cursor(self) -> Any:
        if self.dialect == "sqlite":
            # The driver's connection (in Django's transaction all the same): the store's
            # SQLite statements use :name parameters, which Django's cursor would rewrite.
            self.raw.ensure_connection()
            return self.raw.connection.cursor()
        # Django's cursor hands a dict of parameters to the driver as it is, and every driver
        # of its PostgreSQL and MySQL backends (psycopg 3, psycopg2; mysqlclient, PyMySQL)
        # takes the %(name)s style the stores' statements are written in.
        return self.raw.cursor()

    def execute(self, sql: str, params: dict[str, Any]) -> list[tuple[Any, ...]]:
        cursor = self._cursor()
        try:
            cursor.execute(sql, params)
            return [tuple(row) for row in cursor.fetchall()] if cursor.description else []
        finally:
            cursor.close()

    def changed(self, sql: str, params: dict[str, Any]) -> int:
        cursor = self._cursor()
        try:
            cursor.execute(sql, params)
            return int(cursor.rowcount)
        finally:
            cursor.close()

    def begin(self) -> None:
        raise LeaseError("lease_celery does not open Django transactions: use "
                         "transaction.atomic() (or self.lease.atomic())")

    def commit(self) -> None:
        raise LeaseError("Django commits its own transactions")

    def rollback(self) -> None:
        raise LeaseError("Django rolls back its own transactions")


class DjangoLease(LeaseHandle):
    """``self.lease`` of a :class:`~lease_celery.contrib.django.task.LeasedDjangoTask`: the
    lease handle, and :meth:`atomic`."""

    @contextmanager
    def atomic(self, using: str | None = None, *, durable: bool = False) -> Iterator[Any]:
        """``transaction.atomic(using)`` whose commit is the key's finish::

            with self.lease.atomic() as tx:
                Order.objects.filter(pk=order_id).update(paid=True)
                Payment.objects.create(order_id=order_id, token=self.lease.token)
                return tx.complete({"paid": order_id})     # the key's result

        The lease is verified current under a lock on its row as the block starts; when it
        ends, the finish is written in the same transaction, fenced again. The models and
        the accepted outcome commit together or not at all: a stale owner's block rolls back
        with ``LeaseLost``. ``using``: the database alias (default: the store's,
        ``django://ALIAS``); it must be the lease store's database. Outside calls (HTTP,
        email) stay with ``self.effect(...)``.
        """
        from django.db import transaction

        alias = using or alias_of(self._execution.store.url)
        with transaction.atomic(using=alias, durable=durable), \
                self.transaction(DjangoConnection(alias)) as tx:
            yield tx
