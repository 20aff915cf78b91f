"""What the chaos workers record, and the two faults injected from inside them.

Recording (into the event log): the lease signals (with key, token, owner, and the task id
when the signal is sent from the task's own thread), Celery's ``task_received`` (the worker's
consumer got the message and kombu holds it as unacked), the result backend's own writes
as ``result_write`` events, ``worker_ready`` (main process) and ``process_init`` (each pool
child, with its parent's pid, so the checker knows which processes a group kill ended).

Faults (armed by the harness with :class:`~benchmarks.chaos.flags.Flags` tickets):

- ``sweep_kill``: ``lease_celery.worker.sweeper.sweep`` is wrapped (monkeypatched from here, the
  library is not edited) so that the store it sweeps kills this worker's whole process group
  right after ``store.sweep_expired`` returned marked rows and before any is re-published.
- ``finish_exit``: a ``lease_finished`` receiver calls ``os._exit(1)`` in the pool process
  running ``chaos.job``: the finish was accepted, Celery has not stored the result yet.
- ``finish_hold``: at the same point the pool process publishes its own message again (same
  id, arguments and links: a redelivery) and stalls (1.25 × ttl, longer until another process
  has dealt with that duplicate, 5 × ttl at most) before Celery goes on.

And a watchdog: a worker whose harness is gone kills its own group, so no run leaves orphans.
"""

from __future__ import annotations

import functools
import os
import signal
import threading
import time
from typing import Any

from celery import signals as celery_signals

import lease_celery
from lease_celery.worker import sweeper

from .calls import record_store_calls
from .config import JOB_TASK, ChaosConfig
from .events import EventLog
from .flags import Flags

__all__ = ["install"]

#: Lease signals recorded as events of the same name.
RECORDED_SIGNALS = ("lease_acquired", "lease_taken_over", "lease_swept", "lease_dead",
                    "lease_released", "lease_lost", "lease_retry", "duplicate_deferred",
                    "duplicate_ignored", "stale_result_rejected", "effect_outcome_unknown")

_installed = False


def install(config: ChaosConfig, events: EventLog, flags: Flags) -> None:
    global _installed
    if _installed:
        return
    _installed = True
    for name in RECORDED_SIGNALS:
        getattr(lease_celery.signals, name).connect(_recorder(events, name), weak=False)
    lease_celery.signals.lease_finished.connect(
        _on_finished(events, flags, hold=1.25 * config.ttl), weak=False)
    _record_celery(events)
    record_store_calls(events)
    _install_sweep_kill(events, flags)
    celery_signals.worker_ready.connect(_watchdog(config.harness_pid), weak=False)


def _task_fields(sender: Any) -> dict[str, Any]:
    """Task name, id, parent id and root id, when ``sender`` is a task running in this thread.

    A delivery that re-publishes itself (a deferral) gets itself as parent; its root id stays
    the one of the task that first published it: for a callback, the job it belongs to."""
    request = getattr(sender, "request", None)
    return {"task": getattr(sender, "name", None), "task_id": getattr(request, "id", None),
            "parent_id": getattr(request, "parent_id", None),
            "root_id": getattr(request, "root_id", None)}


def _recorder(events: EventLog, name: str) -> Any:
    def receiver(sender: Any = None, key: str | None = None, **fields: Any) -> None:
        lease = fields.get("lease")
        record = fields.get("record")
        info: dict[str, Any] = {"key": key}
        if lease is not None:
            info.update(token=lease.token, owner=lease.owner)
        elif record is not None:  # lease_swept, duplicate_ignored: the row's snapshot
            task = getattr(record, "task", None) or {}
            info.update(token=record.token, owner=record.owner,
                        swept_task_id=(task.get("options") or {}).get("task_id"))
        if hasattr(sender, "request"):
            info.update(_task_fields(sender))
        for extra in ("reason", "countdown", "holder", "state"):
            if extra in fields:
                info[extra] = fields[extra]
        events.record(name, **info)

    return receiver


def _on_finished(events: EventLog, flags: Flags, hold: float) -> Any:
    def receiver(sender: Any = None, key: str | None = None, lease: Any = None,
                 **_: Any) -> None:
        # Recorded first: the faults below happen after the accepted finish is in the log.
        fields = _task_fields(sender)
        events.record("lease_finished", key=key, token=getattr(lease, "token", None),
                      owner=getattr(lease, "owner", None), **fields)
        if fields["task"] != JOB_TASK:
            return
        if flags.take("finish_exit"):
            events.record("fault", kind="finish_exit", key=key, task_id=fields["task_id"])
            os._exit(1)
        if flags.take("finish_hold"):
            # The same message delivered again (as a broker redelivery or a producer retry
            # would) while this process stalls between its accepted finish and the result
            # write: the duplicate must not complete the task behind a live owner's back.
            events.record("fault", kind="finish_hold", key=key, task_id=fields["task_id"],
                          seconds=hold)
            since = events.length()
            sender.signature_from_request(sender.request).apply_async()
            _hold_until_handled(events, str(fields["task_id"]), since, hold)

    return receiver


#: What another process records once it has dealt with a duplicate delivery of a task id.
_HANDLED = ("result_write", "duplicate_deferred", "duplicate_ignored", "lease_acquired",
            "stale_result_rejected")


def _hold_until_handled(events: EventLog, task_id: str, since: int, hold: float) -> None:
    """Stall at least ``hold`` seconds, and until another process has dealt with the duplicate
    of ``task_id`` (a queue backlog can delay it), at most four times ``hold``."""
    started = time.monotonic()
    while time.monotonic() - started < 4 * hold:
        news = events.read(since)
        since += len(news)
        if any(e.get("task_id") == task_id and e.get("pid") != os.getpid()
               and e.get("event") in _HANDLED for e in news):
            break
        time.sleep(0.1)
    time.sleep(max(0.0, hold - (time.monotonic() - started)))


def _record_celery(events: EventLog) -> None:
    def ready(sender: Any = None, **_: Any) -> None:
        events.record("worker_ready", hostname=getattr(sender, "hostname", None))

    def process_init(**_: Any) -> None:
        events.record("process_init", ppid=os.getppid())

    def received(request: Any = None, **_: Any) -> None:
        # Sent once kombu recorded the message as unacked: a message that never shows up here
        # was lost by the broker transport, before Celery (or the lease) ever saw it.
        events.record("task_received", task=getattr(request, "task_name", None),
                      task_id=getattr(request, "id", None),
                      parent_id=getattr(request, "parent_id", None),
                      root_id=getattr(request, "root_id", None))

    celery_signals.worker_ready.connect(ready, weak=False)
    celery_signals.worker_process_init.connect(process_init, weak=False)
    celery_signals.task_received.connect(received, weak=False)
    _record_result_writes(events)


def _record_result_writes(events: EventLog) -> None:
    """The result backend's own writes (``mark_as_done`` / ``mark_as_failure``, wrapped on
    Celery's base backend class) as ``result_write`` events. Not ``task_success``: Celery sends
    it after a write lease_celery withheld too (an owner that stalled past its settle deadline
    while another delivery completed the key stores nothing)."""
    from celery import current_task
    from celery.backends.base import BaseBackend

    done, failed = BaseBackend.mark_as_done, BaseBackend.mark_as_failure

    def mark_as_done(backend: Any, task_id: str, result: Any, *args: Any, **kwargs: Any) -> Any:
        written = done(backend, task_id, result, *args, **kwargs)
        token = result.get("token") if isinstance(result, dict) else None
        events.record("result_write", state="SUCCESS", token=token,
                      **{**_task_fields(current_task), "task_id": task_id})
        return written

    def mark_as_failure(backend: Any, task_id: str, exc: Any, *args: Any, **kwargs: Any) -> Any:
        written = failed(backend, task_id, exc, *args, **kwargs)
        events.record("result_write", state="FAILURE", exception=repr(exc)[:500],
                      **{**_task_fields(current_task), "task_id": task_id})
        return written

    BaseBackend.mark_as_done = mark_as_done  # type: ignore[method-assign]
    BaseBackend.mark_as_failure = mark_as_failure  # type: ignore[method-assign]


class _DieAfterMark:
    """Wraps a store for one sweep: after ``sweep_expired`` marked rows, and while a
    ``sweep_kill`` ticket is armed, this worker's process group is SIGKILLed before the sweep
    re-publishes anything. Everything else is the wrapped store's."""

    def __init__(self, store: Any, events: EventLog, flags: Flags) -> None:
        self._store, self._events, self._flags = store, events, flags

    def sweep_expired(self, *args: Any, **kwargs: Any) -> Any:
        swept = self._store.sweep_expired(*args, **kwargs)
        if swept and self._flags.take("sweep_kill"):
            self._events.record("fault", kind="sweep_kill", group=os.getpgrp(),
                                keys=[r.key for r in swept], tokens=[r.token for r in swept])
            os.killpg(os.getpgrp(), signal.SIGKILL)
        return swept

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


def _install_sweep_kill(events: EventLog, flags: Flags) -> None:
    original = sweeper.sweep

    @functools.wraps(original)
    def sweep(app: Any, store: Any, *args: Any, **kwargs: Any) -> Any:
        wrapped: Any = _DieAfterMark(store, events, flags)  # a Store in all it is used for
        return original(app, wrapped, *args, **kwargs)

    # SweeperThread and sweep_app look the name up in the module at every sweep.
    sweeper.sweep = sweep


def _watchdog(harness_pid: int) -> Any:
    def watch() -> None:
        stop = threading.Event()
        while not stop.wait(1.0):
            try:
                os.kill(harness_pid, 0)
            except ProcessLookupError:
                os.killpg(os.getpgrp(), signal.SIGKILL)

    def start(**_: Any) -> None:
        threading.Thread(target=watch, name="chaos-watchdog", daemon=True).start()

    return start
