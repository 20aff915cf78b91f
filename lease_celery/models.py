"""Value types shared by the stores and the task layer."""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["EffectState", "EpochReset", "Finding", "HistoryEntry", "Lease", "LeaseRecord",
           "LeaseState", "Receipt", "StoreEpoch", "StoreStats"]


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
    ``expires_at`` is the deadline on the store's clock in epoch seconds; ``fence`` is a
    store-wide number that grows with every claim on any key, so leases of different keys can
    be ordered (see :class:`~lease_celery.FenceGate`). ``attempts`` counts the claims of the
    key so far, this one included; ``takeovers`` those that found the previous owner's lease
    expired (its worker died or stalled).
    """

    key: str
    owner: str
    token: int
    expires_at: float
    fence: int = 0
    # Counters at claim time: information, not identity (a Lease compares by what fences it).
    attempts: int = field(default=1, compare=False)
    takeovers: int = field(default=0, compare=False)
    #: An operator asked to cancel this key (``store.cancel``): the reason, ``cancelled: …``,
    #: as the claim or the last renewal saw it; the holder stops (``LeaseCancelled``).
    cancel: str | None = field(default=None, compare=False)
    #: A limited claim's group (``lease_limit_key``) and the slot token it was granted: the
    #: group's count of grants, which grows on every one (``lease_celery.limits``).
    group: str | None = field(default=None, compare=False)
    slot: int | None = field(default=None, compare=False)


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
    fence: int = 0
    takeovers: int = 0
    not_before: float | None = None
    reason: str | None = None
    task: dict[str, Any] | None = None
    #: ``done``/``dead`` whose owner has not yet confirmed that Celery stored the outcome
    #: (``expires_at`` is then the settle deadline).
    settling: bool = False
    #: The latest progress checkpoint of the key (``LeaseHandle.checkpoint``), kept across
    #: takeovers, retries and requeues, cleared when the key is done.
    checkpoint: Any = None
    #: ``cancelled: …`` while a cancellation waits for the running holder to stop (and on the
    #: dead row it leaves); None otherwise.
    cancel: str | None = None

    def held_by(self, owner: str | None, token: int | None) -> bool:
        """Is the row this owner's generation ``token``? (The one test of "still mine" after
        a refused or lost write, a stall, or for a receipt's attempt.)"""
        return self.owner == owner and self.token == token

    @property
    def task_id(self) -> str | None:
        """The task id of the delivery that last claimed the key. A settled ``done`` row keeps
        only this and ``context`` of its task info (``task`` is then
        ``{"options": {"task_id": ...}, "context": ...}``)."""
        options = (self.task or {}).get("options") or {}
        task_id = options.get("task_id")
        return None if task_id is None else str(task_id)

    @property
    def context(self) -> str | None:
        """Where the outcome of the delivery that last claimed the key went: a digest of its
        canvas place (``lease_celery.execution.delivery.delivery_context``), kept by a settled
        ``done`` row with its task id. None for a row written before it was recorded."""
        context = (self.task or {}).get("context")
        return None if context is None else str(context)


@dataclass(frozen=True)
class HistoryEntry:
    """One event in a key's history (``store.history(key)``).

    ``event``: ``claimed``, ``taken_over``, ``lapsed`` (a holder lost its lease without ending
    it), ``finished``, ``stale_refused``, ``released``, ``retry``, ``dead``, ``swept`` (the
    sweeper re-published the task), ``cancel_requested``, ``answered``, or ``operator:<action>``
    (``detail`` names who). ``at``: epoch seconds on the clock of the process that saw it.
    """

    key: str
    at: float
    event: str
    owner: str | None = None
    token: int | None = None
    fence: int | None = None
    detail: str | None = None


@dataclass(frozen=True)
class StoreStats:
    """Row counts by state; ``expired``: running rows whose lease has run out."""

    counts: dict[str, int]
    expired: int

    @property
    def total(self) -> int:
        return sum(self.counts.values())


@dataclass(frozen=True)
class StoreEpoch:
    """A store's epoch record: what tells it, after its server restarted, whether the writes
    it acknowledged are still there (the Redis store; the SQL stores keep no epoch).

    ``floor``: every token and fence number this epoch hands out is above it (the creation
    time in microseconds on the store's clock, above any counter that grew by one per claim).
    """

    id: str
    created_at: float
    floor: int


@dataclass(frozen=True)
class EpochReset:
    """What ``Store.reset_epoch`` did: the new epoch, and the record it replaced (``replaced``
    its id, ``lost``: why it was marked lost; each None when there was none)."""

    epoch: StoreEpoch
    replaced: str | None
    lost: str | None


class EffectState(str, enum.Enum):
    """Where an effect receipt stands.

    ``in_flight``: the action was started and its outcome is not recorded yet. ``done``: it
    happened; the result is recorded. ``needs_reconciliation``: an attempt may or may not have
    happened; a person must look (``effects.resolve`` / ``effects.discard``).
    """

    IN_FLIGHT = "in_flight"
    DONE = "done"
    NEEDS_RECONCILIATION = "needs_reconciliation"


@dataclass(frozen=True)
class Receipt:
    """The record of one outside action, keyed by a stable business key."""

    key: str
    fingerprint: str
    state: EffectState
    lease_key: str | None
    lease_token: int | None
    lease_owner: str | None
    started_at: float
    attempts: int
    result: Any
    version: int
    updated_at: float


@dataclass(frozen=True)
class Finding:
    """One thing ``celery leases doctor`` says: a ``code`` (``store.redis_eviction``), a
    ``severity`` (``error``: a lease guarantee does not hold; ``warning``: it holds, at a cost
    worth knowing; ``ok``), the ``promise`` it bears on (``delivery``, ``ownership`` or
    ``effects``) and a ``message`` naming the values and what to do. A store's own findings
    (``Store.diagnose``) are of this type too."""

    code: str
    severity: str  # error | warning | ok
    promise: str  # delivery | ownership | effects
    message: str

    def as_dict(self) -> dict[str, str]:
        return asdict(self)
