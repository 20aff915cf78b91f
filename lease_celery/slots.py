"""Beat slots and the checks on beat entries, apart from the scheduler (``lease_celery.beat``).

A slot is the scheduled instant a periodic send is for, computed from the schedule and the
clock alone (the rules: ``lease_celery.beat``'s docstring). These functions import no task and
no scheduler, so ``doctor`` (and the worker's start-up report, which runs it) can judge a
``beat_schedule`` without importing the scheduler, which imports ``LeasedTask``.
"""

from __future__ import annotations

import json
import uuid
from datetime import date, datetime, timedelta, timezone
from typing import Any

from celery.beat import BeatLazyFunc, ScheduleEntry
from celery.schedules import crontab, schedstate, schedule
from celery.utils.time import timezone as celery_timezone

from .apps import is_leased
from .errors import ConfigError
from .keys import resolve_key

__all__ = ["HEADER", "NAMESPACE", "SLOT", "AlignedInterval", "NotSlotted", "entry_problems",
           "is_plain_interval", "request_slot", "schedule_problems", "slot_iso", "slot_of",
           "slot_task_id"]

#: Namespace of the derived task ids. Fixed for good: changing it would give every slot a new
#: id, so a beat of the old version and one of the new would both run the same slot.
NAMESPACE = uuid.UUID("7a52400e-f6d6-577a-8485-c5ec4f3d4ccf")
#: Message header carrying the slot (ISO 8601, UTC); read it with :func:`request_slot`.
HEADER = "lease_slot"
#: An entry argument (in ``args`` or ``kwargs``) equal to this string is replaced by the
#: slot (ISO 8601, UTC) on every send, so a ``lease_key`` can name it. A plain string, so it
#: survives JSON (django-celery-beat, redbeat) and pickle (the shelve file) alike.
SLOT = "{lease_slot}"

UTC = timezone.utc
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MICROSECOND = timedelta(microseconds=1)
#: How far back the latest fire time of a crontab is looked for. The rarest crontab Celery
#: accepts (29 February on one weekday) fires once in 28 years.
CRON_LOOKBACK_DAYS = 29 * 366
#: Local wall-clock order and real-time order differ by at most one UTC-offset change
#: (a DST shift, ≤ 2 h everywhere): scanning this far below the first match is enough.
_OFFSET_CHANGE = timedelta(hours=3)


class NotSlotted(ConfigError):
    """This schedule has no slot rule: its sends cannot get one task id per slot."""


# -- slots ------------------------------------------------------------------------------------

def _utc(moment: datetime) -> datetime:
    """``moment`` in UTC; a naive datetime is UTC (Celery's own convention)."""
    if moment.tzinfo is None:
        return moment.replace(tzinfo=UTC)
    return moment.astimezone(UTC)


def is_plain_interval(sched: Any) -> bool:
    """An interval whose firing rule is Celery's own (a subclass that changes ``is_due`` or
    ``remaining_estimate`` has a rule of its own, which we must not replace)."""
    if type(sched) is AlignedInterval:
        return True
    kind = type(sched)
    return (isinstance(sched, schedule) and kind.is_due is schedule.is_due
            and kind.remaining_estimate is schedule.remaining_estimate)


def interval_slot(period: timedelta, now: datetime) -> datetime:
    """The latest multiple of ``period`` since the Unix epoch at or before ``now`` (UTC).

    Integer microseconds, not float seconds: two beats must agree on the boundary exactly.
    """
    step = period // _MICROSECOND
    if step <= 0:
        raise NotSlotted(f"the interval {period} is not positive")
    elapsed = (_utc(now) - EPOCH) // _MICROSECOND
    return EPOCH + timedelta(microseconds=elapsed - elapsed % step)


def _day_matches(cron: crontab, day: date) -> bool:
    # Celery's crontab fires on a day only if all three day fields match (not cron(8)'s OR).
    return (day.month in cron.month_of_year and day.day in cron.day_of_month
            and day.isoweekday() % 7 in cron.day_of_week)


def cron_slot(cron: crontab, now: datetime) -> datetime:
    """The latest instant at or before ``now`` whose wall-clock time in the crontab's timezone
    matches its five fields (UTC).

    Wall times map to instants as Celery maps them (Python's ``fold=0``): one that occurs
    twice when DST ends counts once, at its first occurrence; one skipped when DST starts
    counts at the instant Python gives it (02:30 in a 02:00→03:00 gap is 03:30).
    """
    now = _utc(now)
    tz = celery_timezone.get_timezone(cron.tz)
    aware_now = now.astimezone(tz)
    local_now = aware_now.replace(tzinfo=None, fold=0)
    # A later wall time can be an earlier instant only across a UTC-offset change (or in the
    # second pass of a repeated hour, where now's own wall time maps to its first pass).
    steady = (_offset(local_now, tz) == aware_now.utcoffset()
              == _offset(local_now + _OFFSET_CHANGE, tz))
    ceiling = local_now if steady else local_now + _OFFSET_CHANGE
    hours, minutes = sorted(cron.hour, reverse=True), sorted(cron.minute, reverse=True)
    day = local_now.date()
    for _ in range(CRON_LOOKBACK_DAYS):
        if _day_matches(cron, day):
            found = _latest_on(day, hours, minutes, tz, now, ceiling)
            if found is not None:
                return found
        day -= timedelta(days=1)
    raise NotSlotted(f"{cron!r} has not fired in the {CRON_LOOKBACK_DAYS} days before {now}")


def _offset(wall: datetime, tz: Any) -> Any:
    return wall.replace(tzinfo=tz).utcoffset()


def _instant(wall: datetime, tz: Any) -> datetime:
    return wall.replace(tzinfo=tz).astimezone(UTC)


def _latest_on(day: date, hours: list[int], minutes: list[int], tz: Any, now: datetime,
               ceiling: datetime) -> datetime | None:
    """The latest fire instant ≤ ``now`` on local ``day``, or None: the highest matching wall
    time whose instant is ≤ now, unless the offset changes in the ``_OFFSET_CHANGE`` below it,
    where a lower wall time may be a later instant: then the latest of those."""
    walls = (datetime(day.year, day.month, day.day, hour, minute)
             for hour in hours if datetime(day.year, day.month, day.day, hour) <= ceiling
             for minute in minutes)
    for wall in walls:
        if wall > ceiling or _instant(wall, tz) > now:
            continue
        floor = wall - _OFFSET_CHANGE
        if _offset(floor, tz) == _offset(wall, tz):
            return _instant(wall, tz)
        near = [_instant(w, tz) for w in walls if w >= floor]  # the rest, in the window
        return max(i for i in [_instant(wall, tz), *near] if i <= now)
    return None


def slot_of(sched: Any, now: datetime) -> datetime:
    """The slot (UTC) that a send of ``sched`` at ``now`` is for; :class:`NotSlotted` if the
    schedule has no slot rule."""
    custom = getattr(sched, "lease_slot", None)
    if callable(custom):
        slot = custom(_utc(now))
        if not isinstance(slot, datetime):
            raise NotSlotted(f"{type(sched).__name__}.lease_slot returned {slot!r}, "
                             "not a datetime")
        return _utc(slot)
    if isinstance(sched, crontab):
        return cron_slot(sched, now)
    if is_plain_interval(sched):
        return interval_slot(sched.run_every, now)
    raise NotSlotted(f"a {type(sched).__name__} schedule ({sched!r}) has no slot rule: only "
                     "crontab, intervals and schedules with a lease_slot(now) method have one")


def slot_iso(slot: datetime) -> str:
    """The canonical text of a slot: ISO 8601 in UTC (``2024-05-01T12:00:00+00:00``)."""
    return _utc(slot).isoformat()


def slot_task_id(entry_name: str, task_name: str, slot: datetime) -> str:
    """The task id of every send of entry ``entry_name`` (task ``task_name``) for ``slot``.

    The task name is part of it so that two apps sharing a lease store, each with an entry
    called "cleanup", do not drop each other's runs.
    """
    name = json.dumps([entry_name, task_name, slot_iso(slot)])  # unambiguous, whatever the names
    return str(uuid.uuid5(NAMESPACE, name))


def request_slot(request: Any) -> datetime | None:
    """The slot of the delivery being run (``request_slot(self.request)`` in a task body), or
    None when it was not sent by a leased scheduler."""
    value = getattr(request, HEADER, None) or (getattr(request, "headers", None) or {}).get(HEADER)
    return datetime.fromisoformat(value) if isinstance(value, str) else None


class AlignedInterval(schedule):  # type: ignore[misc]  # celery ships no type information
    """An interval that fires on multiples of its period since the Unix epoch (UTC).

    Due once the current slot begins after ``last_run_at``'s; the next check is the next
    boundary. ``relative`` is kept for storage and ignored: the alignment replaces it.
    Pickled (shelve) and compared as the plain interval it was made from, so a schedule file
    stays readable by a beat without lease_celery, and the heap is not rebuilt.
    """

    def __init__(self, run_every: Any = None, relative: bool = False, nowfun: Any = None,
                 app: Any = None) -> None:
        super().__init__(run_every, relative, nowfun, app)
        interval_slot(self.run_every, EPOCH)  # refuse a non-positive period now

    @classmethod
    def of(cls, sched: Any) -> AlignedInterval:
        return cls(sched.run_every, sched.relative, sched.nowfun, sched._app)

    def remaining_estimate(self, last_run_at: datetime) -> timedelta:
        last = _utc(self.maybe_make_aware(last_run_at))
        if last < EPOCH:  # "never ran" (redbeat uses year 1): due now, no underflow
            return timedelta(0)
        period: timedelta = self.run_every
        return interval_slot(period, last) + period - _utc(self.now())

    def is_due(self, last_run_at: datetime) -> Any:
        remaining = self.remaining_estimate(last_run_at).total_seconds()
        if remaining > 0:
            return schedstate(False, remaining)
        now = _utc(self.now())
        period: timedelta = self.run_every
        upcoming = interval_slot(period, now) + period - now
        return schedstate(True, upcoming.total_seconds())

    def __reduce__(self) -> Any:
        return schedule, (self.run_every, self.relative, self.nowfun)

    def __repr__(self) -> str:
        return f"<freq: {self.human_seconds}, epoch-aligned>"


# -- checks: what would break "once per slot" -------------------------------------------------

#: Two slots the key check resolves a lease_key for: a key that is equal for both is constant.
_PROBES = ("2000-01-01T00:00:00+00:00", "2000-01-02T00:00:01+00:00")


def _probe_value(value: Any, probe: str, index: int) -> Any:
    if isinstance(value, str) and value == SLOT:
        return probe
    if isinstance(value, BeatLazyFunc):
        return f"<evaluated per send {index} {probe}>"  # varies per send: never call user code
    return value


def _describe(spec: Any) -> str:
    return repr(spec) if isinstance(spec, str) else getattr(spec, "__qualname__", repr(spec))


def entry_problems(app: Any, entry: Any) -> list[tuple[str, str]]:
    """``(code, message)`` for each reason a beat entry's LeasedTask would not run once per
    slot: a schedule with no slot rule, a ``lease_key`` equal in every slot (or that cannot be
    computed from the entry's arguments), a fixed ``task_id`` used as the key. Entries of
    other tasks, or of tasks this process does not know, are not judged."""
    task = app.tasks.get(entry.task)
    if not is_leased(task):
        return []
    where = f"periodic entry {entry.name!r} ({entry.task})"
    problems: list[tuple[str, str]] = []
    try:
        slot_of(entry.schedule, datetime.now(UTC))
    except NotSlotted as exc:
        problems.append(("beat.schedule_unslotted", f"{where}: {exc}. Each beat sends it under "
                         "a fresh task id, so N beats run it N times"))
    spec = task.lease_key
    if spec is None:
        if "task_id" in (entry.options or {}):
            problems.append(("beat.task_id_fixed", f"{where} sets task_id="
                             f"{entry.options['task_id']!r}, its lease key: it runs once, and "
                             "every later tick is dropped as done. Remove the task_id option"))
        return problems
    keys = []
    for index, probe in enumerate(_PROBES):
        args = [_probe_value(v, probe, index) for v in entry.args or ()]
        kwargs = {k: _probe_value(v, probe, index) for k, v in (entry.kwargs or {}).items()}
        try:
            keys.append(resolve_key(spec, task.run, args, kwargs, task_id=f"probe-{index}"))
        except Exception as exc:  # a user's key callable may raise anything
            problems.append(("beat.lease_key_unresolvable", f"{where}: the lease_key "
                             f"{_describe(spec)} cannot be computed from the entry's "
                             f"arguments: {exc}"))
            return problems
    if keys[0] == keys[1]:
        problems.append(("beat.lease_key_constant", f"{where}: the lease_key {_describe(spec)} "
                         f"is {keys[0]!r} in every slot, so the task runs once and every later "
                         "tick is dropped as done. Leave lease_key unset (each slot has a task "
                         "id of its own), or pass lease_celery.beat.SLOT in the entry's "
                         "args/kwargs and name that argument in the key"))
    return problems


def schedule_problems(app: Any) -> list[tuple[str, str]]:
    """:func:`entry_problems` for every entry of ``app.conf.beat_schedule`` (``doctor``)."""
    problems: list[tuple[str, str]] = []
    for name, fields in sorted((app.conf.beat_schedule or {}).items()):
        try:
            entry = ScheduleEntry(**dict(fields, name=name, app=app))
        except Exception as exc:  # celery itself would refuse it at beat start
            problems.append(("beat.entry_invalid", f"periodic entry {name!r} is not a valid "
                             f"beat_schedule entry: {exc}"))
            continue
        problems += entry_problems(app, entry)
    return problems
