"""lease_celery: database-backed ownership leases with fencing for Celery tasks."""

from . import signals
from .effects import Effects, fingerprint
from .errors import (
    ConfigError,
    EffectConflict,
    EffectOutcomeUnknown,
    InvalidKey,
    LeaseError,
    LeaseHeld,
    LeaseLost,
    PayloadNotSerializable,
    ResultNotSerializable,
    StaleFence,
    StoreBusy,
    StoreError,
)
from .fencing import FenceGate
from .handle import LeaseHandle
from .models import EffectState, Lease, LeaseRecord, LeaseState, Receipt
from .settings import LeaseSettings
from .stores import Store, open_store
from .task import LeasedTask

__all__ = [
    "ConfigError",
    "EffectConflict",
    "EffectOutcomeUnknown",
    "EffectState",
    "Effects",
    "FenceGate",
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
    "PayloadNotSerializable",
    "Receipt",
    "ResultNotSerializable",
    "StaleFence",
    "Store",
    "StoreBusy",
    "StoreError",
    "fingerprint",
    "open_store",
    "signals",
]
