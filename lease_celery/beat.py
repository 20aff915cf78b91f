"""Periodic tasks that run once per scheduled slot, however many beats send them.

``celery beat`` sends every periodic task under a fresh task id, so two beats (or a failover
that overlaps the old one) send each tick twice, and a LeasedTask keyed by its task id runs
twice. :class:`LeasedScheduler` (``celery beat -S lease_celery.beat:LeasedScheduler``),
``LeasedRedBeatScheduler`` and ``LeasedDatabaseScheduler`` (redbeat's and django-celery-beat's,
built on first use), and :class:`LeasedSchedulerMixin` (any other) give every send an id
derived from the entry's name, its task and its **slot**: the scheduled instant the send is
for, computed from the schedule and the clock alone, never from the beat's own
``last_run_at``. Every beat sends the same id for the same slot, and the lease keeps one run.

Slot rules (:func:`slot_of`):

* ``crontab``: the latest fire time at or before now, by the crontab's fields in its timezone.
* an interval (``schedule``; a number or a ``timedelta`` in ``beat_schedule``): the latest
  multiple of the period since the Unix epoch (UTC). The entry also *fires* on those
  multiples (:class:`AlignedInterval`), so beats started at different times send each slot at
  the same moment and never drift across a boundary.
* a schedule with a ``lease_slot(now) -> datetime`` method: what that returns.
* anything else (``solar``, django-celery-beat's ``clocked``, redbeat's ``rrule``, custom
  schedules): not slotted. It is sent as Celery sends it (a fresh id: N beats run it N
  times), and the beat logs a warning naming the entry.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

from celery.beat import PersistentScheduler, Scheduler
from celery.beat import SchedulingError as CelerySchedulingError

from .extras import needs
from .slots import (
    HEADER,
    SLOT,
    AlignedInterval,
    NotSlotted,
    entry_problems,
    is_plain_interval,
    request_slot,
    schedule_problems,
    slot_iso,
    slot_of,
    slot_task_id,
)

__all__ = ["HEADER", "SLOT", "AlignedInterval", "LeasedScheduler", "LeasedSchedulerMixin",
           "NotSlotted", "entry_problems", "request_slot", "schedule_problems", "slot_of",
           "slot_task_id"]

logger = logging.getLogger(__name__)

# -- the scheduler ----------------------------------------------------------------------------

class LeasedSchedulerMixin(Scheduler):  # type: ignore[misc]  # celery ships no type information
    """Gives every send of a periodic entry the task id of its slot; put it first:
    ``class S(LeasedSchedulerMixin, DatabaseScheduler): pass``.

    Hooks (all of Celery's ``Scheduler`` API, so any subclass keeps its own logic):
    ``populate_heap`` / ``is_due`` / ``maybe_due`` (redbeat) make interval entries fire on
    their epoch-aligned boundaries; ``apply_async`` sends a copy of the entry whose options
    carry the slot's ``task_id`` and a ``lease_slot`` header, and whose ``SLOT`` arguments
    are filled in. The stored entry is never changed, apart from the aligned interval object,
    which is stored as the plain interval it replaces.
    """

    def _lease_note(self, entry: Any, code: str, message: str) -> None:
        """Log a problem once per entry and kind for the life of this beat."""
        noted: set[tuple[str, str]] = self.__dict__.setdefault("_lease_noted", set())
        if (entry.name, code) not in noted:
            noted.add((entry.name, code))
            logger.warning("lease_celery.beat: %s", message)

    def _lease_prepare(self, entry: Any) -> None:
        if not isinstance(entry.schedule, AlignedInterval) and is_plain_interval(entry.schedule):
            try:
                entry.schedule = AlignedInterval.of(entry.schedule)
            except NotSlotted as exc:
                self._lease_note(entry, "beat.schedule_unslotted",
                                 f"periodic entry {entry.name!r}: {exc}")
        checked: set[str] = self.__dict__.setdefault("_lease_checked", set())
        if entry.name not in checked:
            checked.add(entry.name)
            for code, message in entry_problems(self.app, entry):
                self._lease_note(entry, code, message)

    def populate_heap(self, *args: Any, **kwargs: Any) -> None:
        for entry in self.schedule.values():
            self._lease_prepare(entry)
        super().populate_heap(*args, **kwargs)

    def is_due(self, entry: Any) -> Any:
        self._lease_prepare(entry)
        return super().is_due(entry)

    def maybe_due(self, entry: Any, *args: Any, **kwargs: Any) -> Any:
        # redbeat's tick asks entry.is_due() here, on an entry it just loaded from Redis.
        self._lease_prepare(entry)
        return super().maybe_due(entry, *args, **kwargs)

    def apply_async(self, entry: Any, producer: Any = None, advance: bool = True,
                    **kwargs: Any) -> Any:
        self._lease_prepare(entry)  # before reserve: the next entry carries the alignment
        if advance:
            entry = self.reserve(entry)
        try:
            send = self._lease_send(entry)
        except NotSlotted as exc:
            self._lease_note(entry, "beat.schedule_unslotted",
                             f"periodic entry {entry.name!r}: {exc}; sent under a fresh task "
                             "id, so N beats run it N times")
            return super().apply_async(entry, producer=producer, advance=False, **kwargs)
        except Exception as exc:
            raise CelerySchedulingError(f"Couldn't compute the slot of scheduled task "
                                        f"{entry.name}: {exc!r}") from exc
        # A scheduler that reloads its entries can find one due again within the slot it
        # just sent (django-celery-beat re-reads last_run_at from its table whenever another
        # beat saved a row): the lease would drop the second run, but a beat sends a slot once.
        task_id, slot = send.options["task_id"], send.options["headers"][HEADER]
        sent: dict[str, tuple[str, str]] = self.__dict__.setdefault("_lease_sent", {})
        if sent.get(entry.name) == (task_id, slot):
            logger.info("lease_celery.beat: %s: slot %s was sent already by this beat",
                        entry.name, slot)
            return self.app.AsyncResult(task_id)
        result = super().apply_async(send, producer=producer, advance=False, **kwargs)
        sent[entry.name] = (task_id, slot)  # only once sent: a failed send is sent again
        return result

    def _lease_send(self, entry: Any) -> Any:
        """A shallow copy of ``entry`` (same class, so subclasses' hooks still see their own
        entry type) with the slot's task id, header and ``SLOT`` arguments."""
        slot = slot_of(entry.schedule, entry.schedule.now())
        text = slot_iso(slot)
        options = dict(entry.options or {})
        # A copy of the headers too: Celery adds celery_beat_task to the dict it is given.
        options["headers"] = {**(options.get("headers") or {}), HEADER: text}
        if "task_id" in options:
            self._lease_note(entry, "beat.task_id_fixed",
                             f"periodic entry {entry.name!r} sets task_id="
                             f"{options['task_id']!r}: kept, so every slot is sent under that "
                             "one id")
        else:
            options["task_id"] = slot_task_id(entry.name, entry.task, slot)
        send = object.__new__(type(entry))
        send.__dict__.update(entry.__dict__)
        send.options = options
        send.args = [_fill(value, text) for value in entry.args or ()]
        send.kwargs = {key: _fill(value, text) for key, value in (entry.kwargs or {}).items()}
        return send

    @property
    def info(self) -> str:
        lines = [super().info, "    . leases -> one task id per (entry, slot)"]
        return "\n".join(line for line in lines if line)


def _fill(value: Any, slot: str) -> Any:
    return slot if isinstance(value, str) and value == SLOT else value


class LeasedScheduler(LeasedSchedulerMixin, PersistentScheduler):  # type: ignore[misc]
    """Celery's default scheduler (a shelve file per beat) with one task id per slot:
    ``celery -A proj beat -S lease_celery.beat:LeasedScheduler``."""


#: The mixin on third-party schedulers, built on first use (lease_celery requires neither):
#: ``-S lease_celery.beat:LeasedRedBeatScheduler`` or ``:LeasedDatabaseScheduler``.
_THIRD_PARTY = {
    "LeasedRedBeatScheduler": ("redbeat", "RedBeatScheduler", "celery-redbeat"),
    "LeasedDatabaseScheduler": ("django_celery_beat.schedulers", "DatabaseScheduler",
                                "django-celery-beat"),
}


def __getattr__(name: str) -> Any:
    """``LeasedRedBeatScheduler`` / ``LeasedDatabaseScheduler``: the mixin first, then redbeat's
    ``RedBeatScheduler`` / django-celery-beat's ``DatabaseScheduler`` (which needs Django set
    up, as that scheduler itself does); an ImportError naming the package when it is missing."""
    if name not in _THIRD_PARTY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, base, package = _THIRD_PARTY[name]
    with needs(f"lease_celery.beat.{name}", package):
        scheduler = getattr(importlib.import_module(module), base)
    made = type(name, (LeasedSchedulerMixin, scheduler), {
        "__module__": __name__, "__qualname__": name,
        "__doc__": f"{module}.{base} with one task id per slot."})
    globals()[name] = made  # one class for good: later look-ups do not come here
    return made
