"""``install()``: connect every Celery signal lease_celery needs, once per process.

Nothing is connected by importing a module. ``LeasedTask`` calls ``install()`` when Celery
binds it to an app, which every process that runs, publishes or schedules leased tasks does
(a worker binds its tasks before it sends ``worker_init``); ``LeasedScheduler`` calls it too.
Calling it again, or yourself, is harmless.

What it connects, each module's own ``install``:
- ``worker``: the store check at start, the name findings, the sweeper and metrics server,
  giving leases back at shutdown;
- ``timelimits``: a hard time limit the pool told (``task_failure``);
- ``settle``: an outcome Celery could not store (``task_postrun``);
- ``published``: a message a worker drops unrun takes its row written at publish
  (``task_revoked``);
- ``history`` and ``metrics``: lease_celery's own signals.
"""

from __future__ import annotations

import threading

from . import metrics
from .execution import published, settle
from .runtime import history
from .worker import lifecycle as worker
from .worker import timelimits

__all__ = ["install"]

_lock = threading.Lock()
_installed = False


def install() -> None:
    """Connect lease_celery's signal receivers in this process; idempotent."""
    global _installed
    with _lock:
        if _installed:
            return
        for part in (history, metrics, published, settle, timelimits, worker):
            part.install()
        _installed = True
