"""Recovery that does not wait on the broker: re-publish every row nobody else will run.

When a whole worker host dies, Redis hands its unacked message out again only after the
visibility timeout (default 1 h) plus kombu's restore sweep; RabbitMQ after the connection
drops or ``consumer_timeout``; with early acks, never. The lease row knows sooner. No orphan:
every row that is not terminal is re-published when nobody will run it otherwise:

- ``running`` with an expired lease: its owner died or stalled;
- settling past its settle deadline: its owner died before Celery stored the outcome (the
  re-published delivery completes it: result and callbacks, same ids);
- ``ready`` and unclaimed ``lease_sweep_grace`` seconds after it became claimable: its retry
  or re-published message was lost;
- a parked delivery of a limit group with a free slot, not handed on within a grace period
  (the slot's holder died: it freed the slot by expiring, and handed nothing on).

A row written at publish (``lease_record_at_publish``) and never claimed may only be waiting
behind the backlog of its queue: it is not re-published while the broker says that queue is
not empty, for at most
``QUEUE_WAIT_GRACES`` grace periods; then it is, whatever the queue holds. Where the broker
cannot tell, the grace alone decides, as before.

Each row is marked by a conditional write that leaves it alone for the grace period, so
concurrent sweepers never double a re-publish, and a sweeper killed between its mark and its
publish leaves a mark that expires. Re-publishing twice is harmless: the lease dedups it.

Run it as the ``lease_celery.sweep`` task (beat), ``celery leases sweep`` (cron), or let each
worker run it in a thread every ``lease_sweep_interval`` seconds (the default).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any

from celery import shared_task
from kombu.exceptions import ChannelError

from .. import signals
from ..apps import leased_tasks
from ..errors import LeaseError
from ..execution.delivery import republish
from ..execution.limited import publish_waiters
from ..execution.recovery import queue_of
from ..limits import Waiter
from ..models import LeaseRecord, LeaseState
from ..runtime import green, history
from ..settings import retention, sweep_grace
from ..stores.base import PURGE_BATCH, Store
from ..stores.registry import open_store, shared_store

__all__ = ["QUEUE_WAIT_GRACES", "QueueLengths", "SweepReport", "SweeperThread",
           "leased_store_urls", "prune", "sweep", "sweep_app", "sweep_report"]

logger = logging.getLogger(__name__)


#: A ready row whose queue holds messages waits for them at most this many grace periods
#: (counted from when it became claimable) before it is re-published anyway.
QUEUE_WAIT_GRACES = 10


class QueueLengths:
    """How many messages wait in the queue a row's task goes to, asked of the broker once per
    queue per sweep; None where it cannot tell (no such queue, a transport without counts)."""

    def __init__(self, app: Any, connection: Any = None) -> None:
        self.app, self.connection = app, connection
        self._known: dict[str, int | None] = {}

    def of(self, info: dict[str, Any]) -> int | None:
        queue = queue_of(self.app, info)
        if queue is None:  # a row whose routing cannot be worked out here: unknown
            return None
        name = str(queue.name)
        if name not in self._known:
            self._known[name] = self._count(name)
        return self._known[name]

    def _count(self, queue: str) -> int | None:
        try:
            # A channel of its own: RabbitMQ closes the channel a passive declare of a missing
            # queue fails on, and the connection's default one carries the re-publishes.
            with self.app.connection_or_acquire(self.connection) as conn, \
                    conn.channel() as channel:
                # kombu's Redis transport answers a passive declare with "no such queue"
                # under global_keyprefix (its check looks for the key without the prefix),
                # which would read as an empty queue. A declare there creates nothing (a
                # Redis list exists once pushed to) and counts through the prefix.
                passive = conn.transport.driver_type != "redis"
                declared = channel.queue_declare(queue=queue, passive=passive)
            return int(declared.message_count)
        except ChannelError:  # no such queue: nothing waits in it
            return 0
        except Exception:
            logger.debug("lease sweeper: the broker did not count queue %r", queue,
                         exc_info=True)
            return None


@dataclass(frozen=True)
class SweepReport:
    """What one sweep did with the rows nobody else will run."""

    #: Rows whose task was published again.
    republished: list[LeaseRecord] = field(default_factory=list)
    #: Rows whose publish failed, with why: unmarked, so the next sweep tries again.
    failed: list[tuple[LeaseRecord, str]] = field(default_factory=list)
    #: Rows with no task recorded: nothing to publish (a row written by hand, say).
    no_task: list[LeaseRecord] = field(default_factory=list)
    #: Ready rows left for a later sweep because their queue still holds messages (how many).
    waiting: list[tuple[LeaseRecord, int]] = field(default_factory=list)
    #: Parked deliveries of limit groups with a free slot nobody handed on (its holder died,
    #: or a hand-on's publish was lost), published again.
    handed_on: list[Waiter] = field(default_factory=list)


def sweep(app: Any, store: Store, *, limit: int = 100, grace: float | None = None,
          connection: Any = None) -> list[LeaseRecord]:
    """Re-publish the tasks of the rows in ``store`` that nobody will run otherwise; return
    the records whose task was published again (``sweep_report`` also tells the failures).
    ``grace`` defaults to the app's ``lease_sweep_grace``; ``connection``, a broker
    connection to publish on (default: the app's producer pool)."""
    return sweep_report(app, store, limit=limit, grace=grace,
                        connection=connection).republished


def sweep_report(app: Any, store: Store, *, limit: int = 100, grace: float | None = None,
                 connection: Any = None) -> SweepReport:
    """``sweep``, telling apart the rows re-published, those whose publish failed and those
    with no task to publish."""
    grace = sweep_grace(app) if grace is None else grace
    swept = store.sweep_expired(limit=limit, grace=grace)
    options = {} if connection is None else {"connection": connection}
    report = SweepReport()
    queues = QueueLengths(app, connection)
    now = store.now() if swept else 0.0  # one clock read per sweep, not per row
    for record in swept:
        if record.task is None:
            report.no_task.append(record)
            continue
        waiting = _behind_backlog(record, queues, grace, now)
        if waiting:
            # The mark brings it back a grace period from now.
            logger.info("lease %s: ready and unclaimed, but %d messages wait in its queue: "
                        "not re-published yet", record.key, waiting)
            report.waiting.append((record, waiting))
            continue
        try:
            republish(app, record.task, recovery=True, **options)
        except Exception as exc:  # one bad row must not stop the others
            why = f"{type(exc).__name__}: {exc}"
            logger.warning("lease %r: could not re-publish its task (%s); the next sweep tries "
                           "again", record.key, why)
            logger.debug("re-publish of lease %r failed", record.key, exc_info=True)
            store.sweep_unmark(record.key, record.token)
            report.failed.append((record, why))
            continue
        logger.warning("lease %s (%s%s, owner %s, token %s): nobody will run it; task %s "
                       "re-published", record.key, record.state.value,
                       ", settling" if record.settling else "", record.owner, record.token,
                       record.task_id)
        _note_swept(store, record)
        signals.lease_swept.send(sender=app, key=record.key, record=record)
        report.republished.append(record)
    # A holder that died frees its slot by expiring: nobody hands its group's waiters on.
    report.handed_on.extend(publish_waiters(app, store.hand_on(grace=grace, limit=limit),
                                            **options))
    return report


def _behind_backlog(record: LeaseRecord, queues: QueueLengths, grace: float,
                    now: float) -> int:
    """How many messages a row written at publish (ready, never claimed) may still be waiting
    behind (0: none, or the broker cannot tell, or it waited ``QUEUE_WAIT_GRACES`` grace
    periods already). A retry's row is re-published after the grace alone, as before."""
    if record.state is not LeaseState.READY or record.task is None or record.attempts:
        return 0
    claimable_at = max(record.not_before or 0.0, record.updated_at or 0.0)
    if now - claimable_at >= QUEUE_WAIT_GRACES * grace:
        return 0
    return queues.of(record.task) or 0


def _note_swept(store: Store, record: LeaseRecord) -> None:
    """The re-publish in the key's history. On the sweeper's real OS thread (green pools) the
    note is made on the hub, with the store the tasks share: history's queue and its writer
    belong to the hub, not to this thread's own store (lease_celery/green.py)."""
    detail = (f"task {record.task_id} re-published "
              f"({record.state.value}{', settling' if record.settling else ''})")

    def note(target: Store) -> None:
        history.note(target, record.key, "swept", owner=record.owner, token=record.token,
                     fence=record.fence, detail=detail)

    if green.on_native_thread():
        green.to_hub(lambda: note(shared_store(store.url)))
    else:
        note(store)


def prune(app: Any, store: Store, *, limit: int = PURGE_BATCH) -> int:
    """Retention: delete up to ``limit`` settled done/dead rows older than the app's
    ``lease_retention`` (none when it is 0), in one short write; tokens never restart."""
    keep_for = retention(app)
    if keep_for <= 0:
        return 0
    pruned = store.purge_older_than(keep_for, limit=limit)
    store.prune_history(keep_for, limit=limit * 10)  # about ten events per key
    if pruned:
        logger.info("lease retention: %d rows older than %.0fs pruned", pruned, keep_for)
    return pruned


def leased_store_urls(app: Any) -> list[str]:
    """The distinct lease stores used by the app's LeasedTasks."""
    return sorted({task.lease_settings.store_url for task in leased_tasks(app)})


def sweep_app(app: Any, *, limit: int = 100) -> list[LeaseRecord]:
    """Sweep every store the app's LeasedTasks use."""
    swept: list[LeaseRecord] = []
    for url in leased_store_urls(app):
        with open_store(url) as store:
            swept += sweep(app, store, limit=limit)
            prune(app, store)
    return swept


def _sweep_task(limit: int = 100) -> int:
    """Beat-schedulable: ``{"task": "lease_celery.sweep", "schedule": 15}``."""
    from celery import current_app

    return len(sweep_app(current_app, limit=limit))


#: Registered in every app (a shared task) as ``lease_celery.sweep``.
sweep_task = shared_task(name="lease_celery.sweep", ignore_result=True)(_sweep_task)


class SweeperThread:
    """Sweeps every ``interval`` seconds in the worker's main process until stopped.

    Under green pools it is a real OS thread (lease_celery/green.py), so a task that never
    yields does not stop it: it opens its own stores there, as everywhere, and publishes on a
    broker connection of its own (the app's producer pool belongs to the hub)."""

    def __init__(self, app: Any, interval: float) -> None:
        self.app, self.interval = app, interval
        self._green = green.active() is not None
        self._stop: threading.Event | green.Event = (
            green.Event() if self._green else threading.Event())
        self._thread: green.NativeThread | None = None

    def start(self) -> None:
        self._thread = green.start_thread(self._run, name="lease-sweeper")

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        stores: dict[str, Store] = {}
        connection = self.app.connection_for_write() if self._green else None
        while not self._stop.wait(self.interval):
            for url in leased_store_urls(self.app):
                try:
                    store = stores.get(url) or stores.setdefault(url, open_store(url))
                    sweep(self.app, store, connection=connection)
                    prune(self.app, store)
                except LeaseError as exc:  # the store is down: try again next round
                    logger.warning("lease sweeper: %s", exc)
                except Exception:
                    logger.exception("lease sweeper failed")
        for store in stores.values():
            store.close()
        if connection is not None:
            connection.release()
