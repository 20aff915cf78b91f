"""The history of every key: each generation's claim, takeover, lapse, outcome, and what the
sweeper and operators did (``store.history(key)``, ``celery leases history KEY``).

The store writes a key's transitions itself, in the statement that makes them (a trigger on
the SQL stores, the script on Redis): claimed, taken_over, finished, released, retry, dead and
completed cost the task no call, and a crash cannot lose them. What is no transition of the
row is written from here: a lease lapsing under its owner, a stale finish refused, a duplicate
answered, a sweeper's re-publish. Those events queue an entry, and one thread per process
writes the queue in batches (every ``FLUSH_INTERVAL``); a worker that goes warm flushes what
is queued, one killed outright may lose the entries of its last fraction of a second. Entries
are pruned with ``lease_retention`` (on Redis: capped per key and deleted with the key).
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from collections import defaultdict
from typing import Any

from .. import signals
from ..errors import LeaseError
from ..models import HistoryEntry, Lease, LeaseRecord
from ..stores.base import Store

__all__ = ["flush", "note"]

logger = logging.getLogger(__name__)

#: Seconds between two batched history writes of a process.
FLUSH_INTERVAL = 0.2
#: Entries a process keeps queued at most while its store cannot take them (oldest dropped).
MAX_QUEUED = 10_000

_lock = threading.Lock()
_queued: list[tuple[Store, HistoryEntry]] = []
_writer_pid = 0


def note(store: Store, key: str, event: str, *, owner: str | None = None,
         token: int | None = None, fence: int | None = None, detail: str | None = None) -> None:
    """Queue one event of ``key`` for the next batched write."""
    global _writer_pid
    entry = HistoryEntry(key, time.time(), event, owner, token, fence,
                         None if detail is None else str(detail)[:2000])
    with _lock:
        _queued.append((store, entry))
        if len(_queued) > MAX_QUEUED:
            del _queued[: len(_queued) - MAX_QUEUED]
        if _writer_pid != os.getpid():  # the first event of this process (or forked child)
            _writer_pid = os.getpid()
            threading.Thread(target=_write_forever, name="lease-history", daemon=True).start()


def flush() -> None:
    """Write every queued entry now, in the calling thread (the process is going)."""
    with _lock:
        batch = _queued[:]
        del _queued[:]
    _write(batch)


def _write_forever() -> None:
    while True:
        time.sleep(FLUSH_INTERVAL)
        try:
            flush()
        except Exception:  # never let the thread die
            logger.exception("lease history write failed")


def _write(batch: list[tuple[Store, HistoryEntry]]) -> None:
    by_store: dict[Store, list[HistoryEntry]] = defaultdict(list)
    for store, entry in batch:
        by_store[store].append(entry)
    for store, entries in by_store.items():
        try:
            store.record_history_many(entries)
        except LeaseError as exc:
            logger.warning("lease history: %d entries not written (%s)", len(entries), exc)


# -- what each signal means in a key's history ------------------------------------------------

def _store_of(sender: Any) -> Store | None:
    """The store of a LeasedTask sender."""
    store = getattr(sender, "lease_store", None)
    return store if isinstance(store, Store) else None


def _receiver(event: str, detail_of: Any = None) -> Any:
    def receive(sender: Any = None, key: str | None = None, lease: Lease | None = None,
                **fields: Any) -> None:
        store = _store_of(sender)
        if store is None or key is None:
            return
        detail = detail_of(fields) if detail_of is not None else None
        note(store, key, event, owner=getattr(lease, "owner", None),
             token=getattr(lease, "token", None), fence=getattr(lease, "fence", None),
             detail=detail)
    return receive


def _reason(fields: dict[str, Any]) -> str | None:
    reason = fields.get("reason")
    return None if reason is None else str(reason)


def _answered(fields: dict[str, Any]) -> str:
    record: LeaseRecord | None = fields.get("record")
    return f"answered a delivery under another task id with the outcome of task " \
           f"{getattr(record, 'task_id', None)} ({fields.get('state')})"


#: The events that are no transition of the row (the store records those itself).
_RECEIVERS = {
    "lease_lost": _receiver("lapsed", _reason),
    "stale_result_rejected": _receiver("stale_refused", _reason),
    "duplicate_answered": _receiver("answered", _answered),
}


def install() -> None:
    """Record lapses, refusals and answers in the history, and flush at exit (wiring)."""
    for name, receive in _RECEIVERS.items():
        getattr(signals, name).connect(receive, weak=False,
                                       dispatch_uid=f"lease_celery.runtime.history.{name}")
    atexit.unregister(flush)  # once, however often installed
    atexit.register(flush)
