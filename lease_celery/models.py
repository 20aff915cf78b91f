"""Value types shared by the stores and the task layer."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Lease", "LeaseRecord", "LeaseState"]


class LeaseState(str, enum.Enum):
    """Where a lease row stands.

    ``ready``: free to claim. ``running``: held until ``expires_at`` (afterwards claimable).
    ``done``: a result was accepted; terminal. ``dead``: given up on; terminal until requeued.
    """

    READY = "ready"
    RUNNING = "running"
    DONE = "done"
    DEAD = "dead"


@dataclass(frozen=True)
class Lease:
    """Proof of one successful claim: what renew, finish and release are checked against.

    ``token`` is the claim's generation on this key (+1 per successful claim, never reused);
    ``expires_at`` is the deadline on the store's clock in epoch seconds.
    """

    key: str
    owner: str
    token: int
    expires_at: float


@dataclass(frozen=True)
class LeaseRecord:
    """A snapshot of a lease row as the store holds it."""

    key: str
    state: LeaseState
    owner: str | None
    token: int
    expires_at: float | None
    attempts: int
    result: Any = None
    updated_at: float | None = None

    @classmethod
    def from_row(cls, row: Sequence[Any], *, result: Any) -> LeaseRecord:
        """Build from ``(key, state, owner, token, expires_at, attempts, _, updated_at)``."""
        return cls(key=row[0], state=LeaseState(row[1]), owner=row[2], token=int(row[3]),
                   expires_at=None if row[4] is None else float(row[4]),
                   attempts=int(row[5]), result=result,
                   updated_at=None if row[7] is None else float(row[7]))
