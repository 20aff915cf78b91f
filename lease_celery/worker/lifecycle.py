"""Wiring to Celery's worker signals: the sweeper thread, and giving leases back at shutdown.

Imported by ``lease_celery.task``, so any app that uses LeasedTask gets it. A prefork child
terminated on a cold shutdown (or the soft-shutdown timeout) gets billiard's SIGTERM handler,
which raises ``SystemExit`` in the task: ``LeasedTask`` releases the lease on the way out. A
child that exits normally, and the solo and thread pools, give back what is left here.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from celery import signals as celery_signals

from ..apps import leased_tasks
from ..doctor import diagnose
from ..errors import LeaseError
from ..execution.completion import Completion
from ..runtime import history
from ..runtime.heartbeat import Heartbeat
from ..settings import check_app_settings, metrics_addr, metrics_port, sweep_interval
from ..stores.registry import open_store
from ..stores.urls import redact
from .sweeper import SweeperThread, leased_store_urls
from .visibility import VisibilityExtender, extending_tasks, visibility_timeout

__all__ = ["release_held_leases"]

logger = logging.getLogger(__name__)

#: Bound on giving leases back at shutdown (Celery wants worker handlers back within 4 s).
SHUTDOWN_RELEASE_TIMEOUT = 2.0

_sweepers: dict[int, SweeperThread] = {}
_extenders: dict[int, VisibilityExtender] = {}


def release_held_leases(reason: str) -> int:
    """Give back every lease this process still holds, within a bounded time.

    Runs in a helper thread: if the interrupted thread holds a store's lock, we give up after
    ``SHUTDOWN_RELEASE_TIMEOUT`` rather than hang the shutdown (the lease then just expires).
    """
    heartbeat = Heartbeat.current()
    if heartbeat is None:
        return 0
    released: list[int] = []

    def give_back() -> None:
        # Finishes written behind their task's return first: a lease released before its
        # accepted finish lands would run the task again.
        heartbeat.writes.flush(SHUTDOWN_RELEASE_TIMEOUT / 2)
        heartbeat.confirmations.flush()
        history.flush()  # outcomes Celery stored: confirm them before going
        count = 0
        for execution in heartbeat.abandon():
            if Completion(execution.task, execution).release(reason):
                execution.mark_lost(reason)
                count += 1
        released.append(count)

    worker = threading.Thread(target=give_back, name="lease-release", daemon=True)
    worker.start()
    worker.join(SHUTDOWN_RELEASE_TIMEOUT)
    return released[0] if released else 0


def _check_stores(sender: Any = None, **_: Any) -> None:
    """At worker start, open every store the app's LeasedTasks use (paths, URL options): a bad
    one stops the worker with a message, instead of failing every task later."""
    app = getattr(sender, "app", None)
    if app is None:
        return
    # Every app-wide setting (lease_recovery_priority is read at every recovery): refused
    # here, not there.
    refused = check_app_settings(app)
    if refused:
        raise SystemExit(f"lease_celery: {refused[0]}") from refused[0]
    for url in leased_store_urls(app):
        try:
            open_store(url).close()
        except ImportError as exc:
            # The store's extra is missing: one line, no traceback (the chained import error
            # only repeats it). Logging is not set up yet at worker_init: SystemExit's
            # message is what reaches the terminal.
            raise SystemExit(f"lease_celery: lease_store_url {redact(url)}: {exc}") from None
        except LeaseError as exc:
            logger.critical("lease_store_url %s is not usable: %s", url, exc)
            # SystemExit, not an Exception: Celery's Signal.send would swallow the latter.
            raise SystemExit(f"lease_celery: lease_store_url {url} is not usable: {exc}"
                             ) from exc


def _log_findings(sender: Any = None, instance: Any = None, **_: Any) -> None:
    """Once per worker, at start, in its main process (``celeryd_after_setup``: logging is
    set up, the pool not yet started, so no pool process repeats it): each warning and error
    ``celery leases doctor`` finds for this worker's app, one line each, with its code.

    Users read a worker's log long before they learn that doctor exists. Nothing found here
    stops the worker: what must stop it (a store that cannot open, a refused app setting)
    already did at ``worker_init``; a misspelled name breaks nothing, it does nothing. The
    report never fails the start either: a diagnosis that cannot run is one line saying so."""
    app = getattr(instance, "app", None)
    if app is None:
        return
    try:
        findings = diagnose(app)
    except Exception as exc:  # diagnose never raises on what it judges; this is a safety net
        logger.warning("lease_celery doctor: could not check the app: %s: %s",
                       type(exc).__name__, exc)
        return
    for finding in findings:
        if finding.severity == "ok":
            continue
        level = logging.ERROR if finding.severity == "error" else logging.WARNING
        logger.log(level, "lease_celery doctor: [%s] %s", finding.code, finding.message)


def _on_process_shutdown(**_: Any) -> None:
    release_held_leases("worker process shutdown")


def _start_sweeper(sender: Any = None, **_: Any) -> None:
    app = getattr(sender, "app", None)
    if app is None or not leased_store_urls(app):
        return
    interval = _sweep_interval(app)
    port = metrics_port(app)
    if port:
        from ..metrics import serve

        serve(port, metrics_addr(app))
        logger.info("lease metrics served on port %s", port)
    _start_extender(app)
    if interval <= 0:
        return
    sweeper = SweeperThread(app, interval)
    _sweepers[id(app)] = sweeper
    sweeper.start()
    logger.info("lease sweeper started: every %.1fs", interval)


def _start_extender(app: Any) -> None:
    """``lease_extend_visibility``: the thread that keeps running messages invisible."""
    names = extending_tasks(app)
    timeout = visibility_timeout(app)
    if not names:
        return
    if timeout is None:
        logger.warning("lease_extend_visibility is on for %s, but the broker has no "
                       "visibility timeout to extend: it does nothing", ", ".join(sorted(names)))
        return
    extender = VisibilityExtender(app, timeout, names)
    _extenders[id(app)] = extender
    extender.start()
    logger.info("lease visibility extension started: every %.1fs, for %s", extender.tick,
                ", ".join(sorted(names)))


def _on_worker_shutdown(sender: Any = None, **_: Any) -> None:
    app = getattr(sender, "app", None)
    sweeper = _sweepers.pop(id(app), None) if app is not None else None
    if sweeper is not None:
        sweeper.stop()
    extender = _extenders.pop(id(app), None) if app is not None else None
    if extender is not None:
        extender.stop()
    # The solo, thread and green pools run tasks in this process.
    release_held_leases("worker shutdown")
    heartbeat = Heartbeat.current()
    if heartbeat is not None:  # green pools: its threads' own store connections, closed
        heartbeat.close_thread_stores(SHUTDOWN_RELEASE_TIMEOUT / 2)


def _sweep_interval(app: Any) -> float:
    configured = sweep_interval(app)
    if configured is not None:
        return configured
    ttls = [task.lease_settings.ttl for task in leased_tasks(app)]
    return min(ttls) / 2 if ttls else 0.0


def install() -> None:
    """Connect the worker's lifecycle signals (wiring)."""
    for signal, receiver in ((celery_signals.worker_init, _check_stores),
                             (celery_signals.celeryd_after_setup, _log_findings),
                             (celery_signals.worker_process_shutdown, _on_process_shutdown),
                             (celery_signals.worker_ready, _start_sweeper),
                             (celery_signals.worker_shutdown, _on_worker_shutdown)):
        signal.connect(receiver, weak=False,
                       dispatch_uid=f"lease_celery.worker.lifecycle.{receiver.__name__}")
