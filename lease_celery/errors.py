"""The one exception tree of lease_celery.

Every class's docstring is its default message, so ``raise LeaseLost()`` already says what
happened. Driver errors never escape raw: the store boundary wraps them in ``StoreError``
(``raise StoreError(...) from exc``) so callers catch one family.
"""

from __future__ import annotations

__all__ = [
    "CheckpointNotSerializable",
    "ConfigError",
    "EffectConflict",
    "EffectOutcomeUnknown",
    "InvalidKey",
    "LeaseCancelled",
    "LeaseDead",
    "LeaseDone",
    "LeaseError",
    "LeaseHeld",
    "LeaseLost",
    "LimitReached",
    "PayloadNotSerializable",
    "ResultNotSerializable",
    "StaleFence",
    "StoreBusy",
    "StoreDataLost",
    "StoreError",
]


class LeaseError(Exception):
    """A lease_celery error."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or (self.__doc__ or "").strip())


class LeaseLost(LeaseError):
    """The lease is no longer held by this owner: stop the protected work."""


class LeaseCancelled(LeaseLost):
    """An operator cancelled this key (``celery leases cancel``): stop the protected work. The
    key ends ``dead`` with the reason ``cancelled: …``."""


class CheckpointNotSerializable(LeaseError, TypeError):
    """The checkpoint cannot be stored: checkpoints must be JSON-serializable."""


class LeaseDead(LeaseError):
    """The key is dead: its failure policy gave up on it. A person can requeue it."""


class LeaseDone(LeaseError):
    """A direct call of a LeasedTask whose key is already done: it did not run again."""


class LeaseHeld(LeaseError):
    """The lease is held by another live owner."""


class LimitReached(LeaseHeld):
    """A limited call that could not wait on the store (an eager or direct call, or arguments
    the store cannot record): its group was full, or its next start was not due yet."""


class InvalidKey(LeaseError, ValueError):
    """The lease key is not valid."""


class ResultNotSerializable(LeaseError, TypeError):
    """The task result cannot be stored: lease results must be JSON-serializable."""


class PayloadNotSerializable(LeaseError, TypeError):
    """The effect payload cannot be fingerprinted: it must be JSON-serializable."""


class StaleFence(LeaseLost):
    """The resource has already accepted a write with a higher fence: this lease is superseded."""


class ConfigError(LeaseError, ValueError):
    """A lease_celery setting or task option is not valid."""


class StoreError(LeaseError):
    """The lease store failed to complete the operation."""


class StoreBusy(StoreError):
    """The lease store stayed locked by other writers for longer than the busy deadline."""


class StoreDataLost(StoreError):
    """The lease store's server lost acknowledged writes (its epoch record is gone or was
    replaced): nothing is granted until an operator runs ``celery -A APP leases reset-epoch
    --accept-data-loss``."""


class EffectConflict(LeaseError):
    """An effect with this key was already recorded with a different payload."""


class EffectOutcomeUnknown(LeaseError):
    """An earlier attempt at this effect may or may not have happened: reconcile it by hand."""
