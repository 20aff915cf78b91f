"""lease_celery: database-backed ownership leases with fencing for Celery tasks."""

from . import signals
from .errors import (
    ConfigError,
    EffectConflict,
    EffectOutcomeUnknown,
    InvalidKey,
    LeaseError,
    LeaseHeld,
    LeaseLost,
    ResultNotSerializable,
    StoreBusy,
    StoreError,
)
from .handle import LeaseHandle
from .models import Lease, LeaseRecord, LeaseState
from .settings import LeaseSettings
from .stores import Store, open_store
from .task import LeasedTask

__all__ = [
    "ConfigError",
    "EffectConflict",
    "EffectOutcomeUnknown",
    "InvalidKey",
    "Lease",
    "LeaseError",
    "LeaseHandle",
    "LeaseHeld",
    "LeaseLost",
    "LeaseRecord",
    "LeaseSettings",
    "LeaseState",
    "LeasedTask",
    "ResultNotSerializable",
    "Store",
    "StoreBusy",
    "StoreError",
    "open_store",
    "signals",
]
