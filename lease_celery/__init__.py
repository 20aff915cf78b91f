"""lease_celery: database-backed ownership leases with fencing for Celery tasks."""

from importlib import metadata as _metadata

from . import signals
from .app_connections import AppConnection
from .effects import Effects, fingerprint
from .errors import (
    CheckpointNotSerializable,
    ConfigError,
    EffectConflict,
    EffectOutcomeUnknown,
    InvalidKey,
    LeaseCancelled,
    LeaseDead,
    LeaseDone,
    LeaseError,
    LeaseHeld,
    LeaseLost,
    LimitReached,
    PayloadNotSerializable,
    ResultNotSerializable,
    StaleFence,
    StoreBusy,
    StoreDataLost,
    StoreError,
)
from .execution.outbox import publish_committed, transaction
from .fencing import FenceGate
from .limits import GroupLimit, LimitGroup, LimitRefused, Rate, Waiter
from .models import EffectState, Lease, LeaseRecord, LeaseState, Receipt
from .runtime.handle import LeaseHandle
from .settings import LeaseSettings
from .stores import Store, open_store
from .task import LeasedTask
from .wiring import install

try:  # the installed distribution's, so it never drifts from pyproject.toml
    __version__: str = _metadata.version("lease-celery")
except _metadata.PackageNotFoundError:  # pragma: no cover - a source tree, not installed
    __version__ = "0+unknown"

__all__ = [
    "AppConnection",
    "CheckpointNotSerializable",
    "ConfigError",
    "EffectConflict",
    "EffectOutcomeUnknown",
    "EffectState",
    "Effects",
    "FenceGate",
    "GroupLimit",
    "InvalidKey",
    "Lease",
    "LeaseCancelled",
    "LeaseDead",
    "LeaseDone",
    "LeaseError",
    "LeaseHandle",
    "LeaseHeld",
    "LeaseLost",
    "LeaseRecord",
    "LeaseSettings",
    "LeaseState",
    "LeasedTask",
    "LimitGroup",
    "LimitReached",
    "LimitRefused",
    "PayloadNotSerializable",
    "Rate",
    "Receipt",
    "ResultNotSerializable",
    "StaleFence",
    "Store",
    "StoreBusy",
    "StoreDataLost",
    "StoreError",
    "Waiter",
    "fingerprint",
    "install",
    "open_store",
    "publish_committed",
    "signals",
    "transaction",
]
