"""Everything a run left behind, read back once the workers have stopped: the history.

Four independent witnesses, each read from where it lives:

- the lease store (``open_store(url).get(key)`` for every job key, ``find`` for the rest: the
  callbacks' rows), and each job's effect receipt;
- the result backend (the state and result of every published task id and callback id);
- the receiver's record of every request it got;
- the event log (what the worker processes and the harness saw, in order);

plus what the broker still holds (the queue, and the unacked messages of workers that died),
so a key that was never claimed can be told apart from a key the library dropped; and, in the
transactional variants, a fifth: the app's own tables (its rows and orders, ``appdb.py``).

:class:`History` is plain data (JSON in ``history.json`` of the run directory), so the checker
can be run again on it: ``python -m benchmarks.chaos.checker history.json``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from .config import CALLBACK_TASK, effect_key
from .events import Event

__all__ = ["AppTables", "BackendEntry", "BrokerMessage", "History", "Published", "Row",
           "collect"]

#: More rows than any run makes: ``find`` returns them all.
FIND_LIMIT = 1_000_000


class AppTables(Protocol):
    """The app's tables of a transactional variant (``appdb.AppDatabase``,
    ``djangodb.DjangoDatabase``)."""

    def read(self) -> tuple[dict[str, list[dict[str, Any]]], dict[str, str]]:
        """Committed app rows (job -> rows) and orders (job -> task id)."""
        ...


@dataclass(frozen=True)
class Published:
    task_id: str
    job: str
    key: str
    kind: str  # "original" | "resend" | "alias"


@dataclass(frozen=True)
class Row:
    key: str
    state: str  # ready | running | done | dead
    token: int
    owner: str | None = None
    reason: str | None = None
    attempts: int = 0
    takeovers: int = 0
    result: Any = None  # the accepted result the row keeps (done)


@dataclass(frozen=True)
class BackendEntry:
    state: str  # PENDING | SUCCESS | FAILURE | ...
    result: Any = None


@dataclass(frozen=True)
class BrokerMessage:
    task_id: str
    task: str
    parent_id: str | None
    root_id: str | None
    where: str  # "queue" (deliverable) | "unacked" (held by a worker, maybe a dead one)


@dataclass
class History:
    store: str
    ttl: float
    published: list[Published]
    rows: dict[str, Row]
    receipts: dict[str, str]  # effect key -> receipt state
    backend: dict[str, BackendEntry]  # task id -> state and result
    events: list[Event]
    received: list[dict[str, Any]]
    broker: list[BrokerMessage]
    notes: list[str] = field(default_factory=list)
    wall_time: float = 0.0
    variant: str = "plain"
    #: Were the jobs published with their ``link`` callbacks? (Not in ``enqueue-tx``, whose
    #: purged queue would take callbacks along that no row brings back.)
    linked: bool = True
    #: The app's committed rows, job -> [{token, pid, task_id}] (transactional variants).
    app_rows: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    #: The committed orders, job -> task id (``enqueue-tx``).
    orders: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), default=str, indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> History:
        data = json.loads(text)
        return cls(
            store=data["store"], ttl=data["ttl"],
            published=[Published(**p) for p in data["published"]],
            rows={k: Row(**r) for k, r in data["rows"].items()},
            receipts=data["receipts"],
            backend={k: BackendEntry(**b) for k, b in data["backend"].items()},
            events=data["events"], received=data["received"],
            broker=[BrokerMessage(**m) for m in data["broker"]],
            notes=data.get("notes", []), wall_time=data.get("wall_time", 0.0),
            variant=data.get("variant", "plain"), linked=data.get("linked", True),
            app_rows=data.get("app_rows", {}), orders=data.get("orders", {}))

    def save(self, path: Path) -> None:
        path.write_text(self.to_json())


# -- reading the witnesses ---------------------------------------------------------------------


def read_store(url: str, published: list[Published]) -> tuple[dict[str, Row], dict[str, str]]:
    from lease_celery import open_store

    rows: dict[str, Row] = {}
    receipts: dict[str, str] = {}
    with open_store(url) as store:
        for record in store.find(limit=FIND_LIMIT):
            rows[record.key] = _row(record)
        for job in sorted({p.job for p in published}):
            key = f"job:{job}"
            found = store.get(key)  # the authoritative read of each job's row
            if found is not None:
                rows[key] = _row(found)
            receipt = store.effects.get(effect_key(job))
            if receipt is not None:
                receipts[effect_key(job)] = str(receipt.state.value)
    return rows, receipts


def _row(record: Any) -> Row:
    return Row(key=record.key, state=str(record.state.value), token=int(record.token),
               owner=record.owner, reason=record.reason, attempts=int(record.attempts),
               takeovers=int(getattr(record, "takeovers", 0)),
               result=record.result if record.state.value == "done" else None)


def read_backend(client: Any, task_ids: list[str]) -> dict[str, BackendEntry]:
    backend = client.backend
    entries = {}
    for task_id in task_ids:
        meta = backend.get_task_meta(task_id)
        result = meta.get("result")
        if isinstance(result, BaseException):
            result = repr(result)
        entries[task_id] = BackendEntry(state=str(meta.get("status")), result=result)
    return entries


def callback_ids(events: list[Event]) -> list[str]:
    """Task ids of the LeasedTask callbacks that ran (their backend entries are read too)."""
    return sorted({str(e["task_id"]) for e in events
                   if e.get("task") == CALLBACK_TASK and e.get("task_id")
                   and e["event"] in ("callback_body", "lease_finished", "result_write")})


def collect(*, store: str, ttl: float, store_url: str, client: Any,
            broker: list[BrokerMessage], published: list[Published], events: list[Event],
            received: list[dict[str, Any]], notes: list[str], wall_time: float,
            variant: str = "plain", linked: bool = True, app: AppTables | None = None
            ) -> History:
    rows, receipts = read_store(store_url, published)
    ids = sorted({p.task_id for p in published} | set(callback_ids(events)))
    app_rows, orders = app.read() if app is not None else ({}, {})
    return History(store=store, ttl=ttl, published=published, rows=rows, receipts=receipts,
                   backend=read_backend(client, ids), events=events, received=received,
                   broker=broker, notes=notes,
                   wall_time=wall_time, variant=variant, linked=linked, app_rows=app_rows,
                   orders=orders)
