"""FenceGate: the resource side of fencing, for a resource shared by many keys' leases.

Per-key tokens each count their own key's claims, so they cannot be compared across keys.
Every claim also takes a store-wide ``fence`` number that only grows (``lease.fence``). A
resource that remembers the highest fence it has accepted, and refuses lower ones *in the same
transaction as the write*, turns away a superseded holder once a newer one has written.

Limit: the resource only remembers the maximum. An old holder's write that arrives *before*
any newer holder has written is still accepted; the gate orders writes, it does not know about
leases that have not written yet. Pair it with the lease checks (``self.lease.check()``,
``fenced()``) for the protected work itself.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from typing import Any, TypeVar

from .errors import ConfigError, StaleFence

__all__ = ["FenceGate"]

_T = TypeVar("_T")

_CREATE = ("CREATE TABLE IF NOT EXISTS {table} "
           "(resource TEXT PRIMARY KEY, fence BIGINT NOT NULL)")
# Insert or raise the high-water mark; a lower fence updates nothing and returns no row. The
# conflicting row stays locked until the transaction ends, so checks and writes serialise.
_ADVANCE = ("INSERT INTO {table} (resource, fence) VALUES ({p}, {p}) "
            "ON CONFLICT (resource) DO UPDATE SET fence = excluded.fence "
            "WHERE {table}.fence <= excluded.fence RETURNING fence")
_HIGHEST = "SELECT fence FROM {table} WHERE resource = {p}"


class FenceGate:
    """Accept a write to ``resource`` only if its fence is >= the highest seen there.

    Works on a DB-API connection to the database that holds the resource: ``sqlite3`` or
    psycopg 3. ``write`` runs the check and your write in one transaction.
    """

    def __init__(self, connection: Any, *, table: str = "lease_celery_fence_gate") -> None:
        if not table.replace("_", "").replace(".", "").isalnum():
            raise ConfigError(f"FenceGate table {table!r} must be a plain identifier")
        self.connection = connection
        self._sqlite = isinstance(connection, sqlite3.Connection)
        placeholder = "?" if self._sqlite else "%s"
        self._advance = _ADVANCE.format(table=table, p=placeholder)
        self._highest = _HIGHEST.format(table=table, p=placeholder)
        self._run_in_transaction(lambda conn: conn.execute(_CREATE.format(table=table)))

    def write(self, resource: str, fence: int, fn: Callable[[Any], _T]) -> _T:
        """Run ``fn(connection)`` if ``fence`` is not below the resource's highest fence.

        Raises :class:`StaleFence` and writes nothing otherwise. ``fn``'s writes and the new
        high-water mark commit together.
        """
        if isinstance(fence, bool) or not isinstance(fence, int) or fence < 1:
            raise ConfigError(f"fence must be a positive int from a lease, got {fence!r}")

        def guarded(conn: Any) -> _T:
            if conn.execute(self._advance, (resource, fence)).fetchone() is None:
                highest = conn.execute(self._highest, (resource,)).fetchone()
                raise StaleFence(f"resource {resource!r} has accepted fence "
                                 f"{highest[0] if highest else '?'}; fence {fence} is stale")
            return fn(conn)

        return self._run_in_transaction(guarded)

    def highest(self, resource: str) -> int | None:
        """The highest fence the resource has accepted, or None."""
        row = self._run_in_transaction(
            lambda conn: conn.execute(self._highest, (resource,)).fetchone())
        return None if row is None else int(row[0])

    def _run_in_transaction(self, body: Callable[[Any], _T]) -> _T:
        conn = self.connection
        if not self._sqlite:
            with conn.transaction():
                return body(conn)
        # sqlite3: take the write lock up front so the check and the write cannot interleave;
        # inside the caller's transaction, a savepoint undoes a failed write (as psycopg does).
        nested = conn.in_transaction
        conn.execute("SAVEPOINT lease_celery_gate" if nested else "BEGIN IMMEDIATE")
        try:
            result = body(conn)
        except BaseException:
            conn.execute("ROLLBACK TO lease_celery_gate" if nested else "ROLLBACK")
            if nested:
                conn.execute("RELEASE lease_celery_gate")
            raise
        conn.execute("RELEASE lease_celery_gate" if nested else "COMMIT")
        return result
