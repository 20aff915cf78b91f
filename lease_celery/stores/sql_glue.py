"""What the two SQL stores share besides the contract: the schema version they write, the
connection (or pool) that belongs to one process, and retention's batches."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import Generic, TypeVar

from ..errors import StoreError
from ..models import EffectState, HistoryEntry, LeaseState
from .base import PURGE_BATCH

__all__ = ["FIND_ARMS", "SCHEMA_VERSION", "PerProcess", "check_schema_version",
           "effect_find_query", "find_queries", "find_query", "grouped", "purge_in_batches"]

#: The schema both SQL stores create and migrate to (see their ``_migrate``/``migrate_*``):
#: 1 leases and effects; 2 the settle phase and the sweeper's index; 3 checkpoints and
#: cancellation; 4 the history table; 5 the store writes each transition into it itself
#: (triggers); 6 key-group limits (the groups' and the waiters' tables, each lease's group and
#: slot); 7 the live and dead rows' indexes for the operator's reads; 8 the receipts' state
#: index (the reconcile queue). Every step only adds: no row is rewritten but schema 1's.
SCHEMA_VERSION = 8

_T = TypeVar("_T")

#: What find() reads for each state, as the predicate that names that state's partial index:
#: ready and running rows through the live index, done ones through the terminal index, dead
#: ones through their own. Each is repeated verbatim from its index's WHERE (SQLite uses a
#: partial index only when the query holds that very term); the second term picks the state.
FIND_ARMS: dict[LeaseState, str] = {
    LeaseState.READY: "state IN ('ready', 'running') AND state = 'ready'",
    LeaseState.RUNNING: "state IN ('ready', 'running') AND state = 'running'",
    LeaseState.DONE: "state IN ('done', 'dead') AND state = 'done'",
    LeaseState.DEAD: "state = 'dead'",
}
#: find() without a state: the ready arm, the running arm and every settled row.
_SETTLED = "state IN ('done', 'dead')"


def find_query(state: LeaseState | None) -> str:
    """The name of find()'s statement for ``state`` (None: any) among a dialect's queries,
    once :func:`find_queries` has added them."""
    return "find_any" if state is None else f"find_{state.value}"


def find_queries(queries: dict[str, str]) -> dict[str, str]:
    """find()'s statements, by :func:`find_query` name, from a dialect's ``list_arm`` (one
    index, newest first) and ``list_merge`` (the newest of the arms' newest) templates."""
    def arm(where: str) -> str:
        return queries["list_arm"].replace("{where}", where)

    found = {find_query(state): arm(where) for state, where in FIND_ARMS.items()}
    found[find_query(None)] = (queries["list_merge"]
                               .replace("{ready}", arm(FIND_ARMS[LeaseState.READY]))
                               .replace("{running}", arm(FIND_ARMS[LeaseState.RUNNING]))
                               .replace("{settled}", arm(_SETTLED)))
    return found


def effect_find_query(state: EffectState | None) -> str:
    """The name of effects.find()'s statement for ``state`` (None: any): one state's is a
    statement of its own, a range of the receipts' state index (schema 8)."""
    return "effect_find_any" if state is None else "effect_find"


#: Connections and pools made before fork(): the parent's, never used or closed by a child
#: (SQLite's locks are per process; a libpq socket shared by two processes interleaves their
#: messages). Parked here so that garbage collection does not close them either.
_INHERITED: list[object] = []


class PerProcess(Generic[_T]):
    """A connection or pool that belongs to the process that made it: after ``fork()`` the
    child sees none and makes its own."""

    def __init__(self) -> None:
        self._value: _T | None = None
        self._pid = 0

    def get(self) -> _T | None:
        """This process's, or None (an inherited one is parked, never touched)."""
        if self._value is not None and self._pid != os.getpid():
            _INHERITED.append(self._value)
            self._value = None
        return self._value

    def set(self, value: _T | None) -> None:
        self._value, self._pid = value, os.getpid()

    def take(self) -> _T | None:
        """Forget it and hand it over to be closed, if it is this process's."""
        value = self.get()
        self._value = None
        return value


def check_schema_version(found: int | None, where: str) -> None:
    """A schema newer than this lease_celery is refused: its rules may not be ours."""
    if found is not None and found > SCHEMA_VERSION:
        raise StoreError(f"{where} has schema version {found}, newer than this lease_celery "
                         f"understands ({SCHEMA_VERSION})")


def purge_in_batches(batch: Callable[[int], int], limit: int | None) -> int:
    """Retention's deletes: ``batch(n)`` deletes up to n rows in one short write and says how
    many; all of them (``limit`` None) in batches of ``PURGE_BATCH``, or at most ``limit``."""
    size = PURGE_BATCH if limit is None else limit
    purged = total = batch(size)
    while limit is None and purged == size:
        purged = batch(size)
        total += purged
    return total


def grouped(entries: Iterable[HistoryEntry]) -> dict[str, list[HistoryEntry]]:
    """History entries (ordered by key, then time) as ``{key: its entries}``."""
    out: dict[str, list[HistoryEntry]] = {}
    for entry in entries:
        out.setdefault(entry.key, []).append(entry)
    return out
