"""Rows to values, by column name: what every backend hands ``Store`` back becomes a
``Lease``, a ``LeaseRecord`` or a ``Receipt`` here, once.

A row is a mapping from the column names of the SQL files (``get``, ``claim``,
``effect_get``) to what the database holds: numbers may come as text (Redis keeps strings),
JSON columns as JSON text, a missing column as absent or None.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from ..checks import decode_result, decode_task
from ..models import EffectState, Lease, LeaseRecord, LeaseState, Receipt

__all__ = ["Row", "lease_of", "receipt_of", "record_of", "task_id_only"]

Row = Mapping[str, Any]


def _number(row: Row, column: str) -> float | None:
    value = row.get(column)
    return None if value is None or value == "" else float(value)


def _count(row: Row, column: str) -> int:
    value = row.get(column)
    return 0 if value is None or value == "" else int(value)


def _text(row: Row, column: str) -> str | None:
    value = row.get(column)
    return None if value is None or value == "" else str(value)


def lease_of(key: str, owner: str, row: Row) -> Lease:
    """The lease a claim (or a settlement claim) took: its row has ``token``, ``expires_at``,
    ``fence``, ``attempts``, ``takeovers`` and, for a claim, ``cancel`` (a limited claim's
    also ``grp`` and ``slot``)."""
    return Lease(key, owner, _count(row, "token"), float(row["expires_at"]), _count(row, "fence"),
                 attempts=_count(row, "attempts"), takeovers=_count(row, "takeovers"),
                 cancel=_text(row, "cancel"), group=_text(row, "grp"),
                 slot=None if _text(row, "slot") is None else _count(row, "slot"))


def record_of(row: Row) -> LeaseRecord:
    """A lease row (the columns of the ``get`` query) as the snapshot users see."""
    return LeaseRecord(
        key=str(row["key"]), state=LeaseState(row["state"]), owner=_text(row, "owner"),
        token=_count(row, "token"), expires_at=_number(row, "expires_at"),
        attempts=_count(row, "attempts"), result=decode_result(_text(row, "result")),
        updated_at=_number(row, "updated_at"), fence=_count(row, "fence"),
        takeovers=_count(row, "takeovers"), not_before=_number(row, "not_before"),
        reason=_text(row, "reason"), task=decode_task(_text(row, "task")),
        settling=bool(_count(row, "settling")), checkpoint=decode_result(_text(row, "checkpoint")),
        cancel=_text(row, "cancel"))


def receipt_of(row: Row) -> Receipt:
    """An effect receipt row (the columns of the ``effect_get`` query)."""
    token = row.get("lease_token")
    return Receipt(key=str(row["key"]), fingerprint=str(row["fingerprint"]),
                   state=EffectState(row["state"]), lease_key=_text(row, "lease_key"),
                   lease_token=None if token is None or token == "" else int(token),
                   lease_owner=_text(row, "lease_owner"), started_at=float(row["started_at"]),
                   attempts=_count(row, "attempts"), result=decode_result(_text(row, "result")),
                   version=_count(row, "version"), updated_at=float(row["updated_at"]))


def task_id_only(task_id: str, context: str | None = None) -> str:
    """The task info a settled ``done`` row keeps, as JSON text: only the task id and the
    delivery's context, in the shape of the task info they were cut from."""
    kept: dict[str, object] = {"options": {"task_id": task_id}}
    if context is not None:
        kept["context"] = context
    return json.dumps(kept)
