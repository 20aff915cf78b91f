"""Periodic tasks under ``lease_celery.beat``: one run per scheduled slot, however many beats.

Unit tests, no processes: the slot rules (crontab against Celery's own fire times across DST
in four timezones; intervals on epoch multiples, and firing there), the derived task id, what
one send carries, composition with schedulers shaped like django-celery-beat's and redbeat's
(their hook structure is mimicked here: neither package is installed), the schedule file, and
the doctor check.

Process tests: real ``celery beat -S lease_celery.beat:LeasedScheduler`` processes (2, then 3,
started 0.7 s apart, each with its own schedule file) and one real ``celery worker`` (prefork)
on a Redis broker (database LEASE_TEST_BEAT_REDIS_DB, 7 by default: no test flushes it, and
every key there, this module's and test_beat_integrations.py's, is a run's own, deleted after)
and a SQLite lease store, with a 1 s interval entry; then the same with Celery's own
``PersistentScheduler``, which runs every tick once per beat.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import random
import shelve
import statistics
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import pytest
import redis
from celery import Celery
from celery.beat import BeatLazyFunc, PersistentScheduler, ScheduleEntry, Scheduler
from celery.schedules import BaseSchedule, crontab, schedstate, schedule

from lease_celery import LeasedTask
from lease_celery.beat import (
    SLOT,
    AlignedInterval,
    LeasedScheduler,
    LeasedSchedulerMixin,
    NotSlotted,
    request_slot,
    slot_of,
    slot_task_id,
)
from lease_celery.doctor import diagnose
from lease_celery.slots import EPOCH, cron_slot, interval_slot
from tests.support.servers import REDIS_HOST, REDIS_PORT, require
from tests.support.workers import REPO, Journal, Worker

UTC = timezone.utc


def at(*fields: int) -> datetime:
    return datetime(*fields, tzinfo=UTC)  # type: ignore[misc]


def make_app(timezone_name: str = "UTC") -> Celery:
    app = Celery("beat-tests", set_as_current=False)
    app.conf.timezone = timezone_name
    return app


# -- intervals ---------------------------------------------------------------------------------

@pytest.mark.parametrize("period", [timedelta(seconds=1), timedelta(seconds=10),
                                    timedelta(minutes=7), timedelta(days=1),
                                    timedelta(milliseconds=250)])
def test_interval_slot_is_the_latest_epoch_multiple(period: timedelta) -> None:
    """The slot is a multiple of the period since 1970-01-01 UTC, at or before now, the same
    for every instant inside it (integer microseconds: no float rounding at a boundary)."""
    rng = random.Random(7)
    for _ in range(200):
        now = EPOCH + timedelta(microseconds=rng.randrange(0, 60 * 365 * 86400 * 10**6))
        slot = interval_slot(period, now)
        assert slot <= now < slot + period
        assert (slot - EPOCH) % period == timedelta(0)
        assert interval_slot(period, slot) == slot
        assert interval_slot(period, slot + period - timedelta(microseconds=1)) == slot


def _simulate(sched_of: Callable[[Callable[[], datetime]], Any], start: float, end: float,
              latency: float) -> list[tuple[float, datetime]]:
    """One beat's sends from ``start`` to ``end`` (epoch s), as Celery's loop drives a schedule:
    ask ``is_due(last_run_at)``, send when due (``last_run_at`` = the send time), sleep the
    returned delay; every wake-up and send takes ``latency`` seconds."""
    clock = [start]
    sched = sched_of(lambda: datetime.fromtimestamp(clock[0], UTC))
    last, sends = datetime.fromtimestamp(start, UTC), []
    while clock[0] < end:
        due, delay = sched.is_due(last)
        if due:
            clock[0] += latency
            now = datetime.fromtimestamp(clock[0], UTC)
            sends.append((clock[0], interval_slot(timedelta(seconds=1), now)))
            last = now
        clock[0] += max(delay, 0.0) + latency
    return sends


def test_aligned_interval_fires_on_the_boundaries_whatever_the_start() -> None:
    """Two beats started 0.7 s apart send every 1 s slot once each, a few ms after its
    boundary, for 300 slots. Celery's own interval, driven the same way, fires 0.7 s apart,
    drifts by the latency every period, and skips slots."""
    app = make_app()

    def aligned(now: Callable[[], datetime]) -> AlignedInterval:
        return AlignedInterval(1.0, nowfun=now, app=app)

    def plain(now: Callable[[], datetime]) -> schedule:
        return schedule(1.0, nowfun=now, app=app)

    start, end, latency = 1_700_000_000.3, 1_700_000_300.0, 0.004
    for beat_start in (start, start + 0.7):
        sends = _simulate(aligned, beat_start, end, latency)
        slots = [slot for _, slot in sends]
        assert len(slots) == len(set(slots)) >= 298
        assert slots == [slots[0] + timedelta(seconds=k) for k in range(len(slots))]
        assert max(t - slot.timestamp() for t, slot in sends) < 0.02
    drifting = [slot for _, slot in _simulate(plain, start, end, latency)]
    assert len(drifting) == len(set(drifting))
    assert len(drifting) < 298  # skipped slots: 0.008 s lost per period


def test_aligned_interval_stores_and_compares_as_the_plain_interval() -> None:
    """Pickled (the shelve file) as Celery's ``schedule``, so a beat without lease_celery reads
    it back; equal to the interval it replaces, so Celery does not rebuild its heap."""
    original = schedule(timedelta(seconds=30), relative=True)
    aligned = AlignedInterval.of(original)
    assert aligned == original
    restored = pickle.loads(pickle.dumps(aligned))
    assert type(restored) is schedule
    assert (restored.run_every, restored.relative) == (timedelta(seconds=30), True)


def test_non_positive_interval_has_no_slot() -> None:
    with pytest.raises(NotSlotted, match="not positive"):
        AlignedInterval(0)
    with pytest.raises(NotSlotted, match="not positive"):
        slot_of(schedule(timedelta(seconds=-5)), at(2024, 1, 1))


def test_aligned_interval_after_never_running_is_due_now() -> None:
    """redbeat's "never ran" is year 1: due at once, without overflowing the epoch floor."""
    sched = AlignedInterval(timedelta(days=365), nowfun=lambda: at(2024, 5, 1, 12), app=make_app())
    due, delay = sched.is_due(datetime(1, 1, 2, tzinfo=UTC))
    assert due
    assert 0 < delay <= 365 * 86400


# -- crontab -------------------------------------------------------------------------------

def _celery_next_fire(cron: crontab, after: datetime) -> datetime:
    """Celery's own next fire time after ``after``: ``is_due`` fires once now reaches it."""
    cron.nowfun = lambda: after
    fire: datetime = after + cron.remaining_estimate(after)
    return fire


CRONTABS = [("*", "*", "*", "*", "*"), ("*/15", "*", "*", "*", "*"),
            ("0", "9", "mon-fri", "*", "*"), ("30", "2", "*", "*", "*"),
            ("0", "0", "*", "29", "2"), ("5", "*/3", "sun", "1-7", "*"),
            ("0,30", "1", "*", "*", "*"), ("59", "1", "*", "*", "*")]


@pytest.mark.parametrize("zone", ["UTC", "Europe/Paris", "America/New_York",
                                  "Australia/Lord_Howe"])
def test_every_celery_fire_time_is_its_own_slot(zone: str) -> None:
    """For random last-run times (half of them in DST-change months), Celery's next fire time
    F is the slot of a send at F and of any send in the minute after it: every beat that
    sends that fire, early or late within the minute, sends F's task id."""
    app = make_app(zone)
    rng = random.Random(zone)
    for fields in CRONTABS:
        minute, hour, dow, dom, moy = fields
        cron = crontab(minute, hour, day_of_week=dow, day_of_month=dom, month_of_year=moy,
                       app=app)
        for _ in range(40):
            if rng.random() < 0.5:
                last = at(2020, 1, 1) + timedelta(seconds=rng.randrange(6 * 365 * 86400))
            else:
                last = at(rng.choice([2021, 2022, 2023]), rng.choice([3, 4, 10, 11]),
                          rng.randrange(1, 29), rng.randrange(24), rng.randrange(60))
            fire = _celery_next_fire(cron, last)
            if fire <= last:
                continue  # Celery's own answer inside a repeated hour: see the next test
            for late in (0.0, 0.5, 30.0, 59.9):
                assert cron_slot(cron, fire + timedelta(seconds=late)) == fire, (fields, last)


def test_crontab_slot_examples() -> None:
    app = make_app()
    quarter = crontab(minute="*/15", app=app)
    assert cron_slot(quarter, at(2024, 5, 1, 12, 7, 30)) == at(2024, 5, 1, 12, 0)
    assert cron_slot(quarter, at(2024, 5, 1, 12, 15)) == at(2024, 5, 1, 12, 15)  # the boundary
    weekdays = crontab(minute=0, hour=9, day_of_week="mon-fri", app=app)
    assert cron_slot(weekdays, at(2024, 5, 4, 10)) == at(2024, 5, 3, 9)  # Saturday → Friday
    leap = crontab(minute=0, hour=0, day_of_month=29, month_of_year=2, app=app)
    assert cron_slot(leap, at(2027, 1, 1)) == at(2024, 2, 29)
    paris = crontab(minute=0, hour=9, app=make_app("Europe/Paris"))
    assert cron_slot(paris, at(2024, 7, 1, 8)) == at(2024, 7, 1, 7)  # 09:00 CEST


def test_a_repeated_wall_time_counts_once() -> None:
    """DST ends in New York at 02:00 EDT on 2021-11-07: 01:00–01:59 happen twice. A beat
    running through it fires those minutes once (Celery goes from 01:59 EDT to 02:00 EST); a
    beat started in the second pass fires on every tick, and each of its sends maps to the
    last first-pass minute, already run: the count does not depend on which beats run."""
    cron = crontab(app=make_app("America/New_York"))
    assert cron_slot(cron, at(2021, 11, 7, 5, 59, 30)) == at(2021, 11, 7, 5, 59)  # 01:59 EDT
    assert _celery_next_fire(cron, at(2021, 11, 7, 5, 59, 0)) == at(2021, 11, 7, 7, 0)
    for second_pass in (at(2021, 11, 7, 6, 10, 5), at(2021, 11, 7, 6, 59, 59)):
        assert cron_slot(cron, second_pass) == at(2021, 11, 7, 5, 59)
    assert cron_slot(cron, at(2021, 11, 7, 7, 0, 1)) == at(2021, 11, 7, 7, 0)  # 02:00 EST


# -- ids and what a send carries ---------------------------------------------------------------

def test_slot_task_id_is_stable_and_distinct() -> None:
    """The same (entry, task, slot) gives the same id on every beat and every version (the
    golden value pins the derivation: changing it would run a slot twice during an upgrade);
    another entry, task or slot gives another."""
    slot = at(2024, 5, 1, 12, 0)
    task_id = slot_task_id("cleanup", "app.tasks.cleanup", slot)
    assert task_id == "ec463a21-1f93-524d-a6db-e0b973d25e01"
    assert uuid.UUID(task_id).version == 5
    assert slot_task_id("cleanup", "app.tasks.cleanup", slot.replace(tzinfo=None)) == task_id
    assert slot_task_id("cleanup", "app.tasks.cleanup",
                        slot.astimezone(timezone(timedelta(hours=2)))) == task_id
    others = {slot_task_id("cleanup2", "app.tasks.cleanup", slot),
              slot_task_id("cleanup", "other.cleanup", slot),
              slot_task_id("cleanup", "app.tasks.cleanup", slot + timedelta(seconds=1))}
    assert task_id not in others and len(others) == 3


class _Capture(LeasedSchedulerMixin):
    """Celery's in-memory ``Scheduler`` with the mixin; records what it would publish."""

    sent: list[dict[str, Any]]

    fail = False

    def send_task(self, name: str, args: Any, kwargs: Any, **options: Any) -> Any:
        if getattr(self, "fail", False):
            raise ConnectionError("the broker is down")
        self.__dict__.setdefault("sent", []).append(
            {"name": name, "args": args, "kwargs": kwargs, **options})
        return None


class _Every5Minutes(crontab):  # type: ignore[misc]
    pass


def _capture(app: Celery, **entries: dict[str, Any]) -> _Capture:
    app.conf.beat_schedule = entries
    return _Capture(app=app, schedule={})


NOW = at(2024, 5, 1, 12, 7, 30)


def test_a_send_carries_the_slot_id_header_and_arguments() -> None:
    """The send has the slot's task id, a ``lease_slot`` header beside the entry's own, and
    ``SLOT`` arguments filled in; the stored entry is unchanged (not even by Celery's own
    ``celery_beat_task`` header, which it adds to the dict it is given)."""
    app = make_app()
    scheduler = _capture(app, report={
        "task": "app.report", "schedule": crontab(minute="*/5", nowfun=lambda: NOW),
        "args": (SLOT, 1), "kwargs": {"slot": SLOT, "n": 2},
        "options": {"headers": {"team": "ops"}, "queue": "reports"}})
    entry = scheduler.schedule["report"]
    scheduler.apply_entry(entry, producer=None)
    other = _Capture(app=app, schedule={})  # a second beat, or a restart: the same send
    other.apply_entry(other.schedule["report"], producer=None)
    slot = at(2024, 5, 1, 12, 5)
    (first,), (second,) = scheduler.sent, other.sent
    assert first == second
    assert first["task_id"] == slot_task_id("report", "app.report", slot)
    assert first["headers"] == {"team": "ops", "lease_slot": slot.isoformat(),
                                "celery_beat_task": True}
    assert first["args"] == [slot.isoformat(), 1]
    assert first["kwargs"] == {"slot": slot.isoformat(), "n": 2}
    assert first["queue"] == "reports"
    assert entry.options == {"headers": {"team": "ops"}, "queue": "reports"}
    assert (entry.args, entry.kwargs) == ((SLOT, 1), {"slot": SLOT, "n": 2})


def test_one_beat_sends_each_slot_once_however_often_the_entry_comes_due() -> None:
    """A scheduler whose entries are reloaded with an older ``last_run_at`` (django-celery-beat
    re-reads its table when another beat saved a row; CI saw one beat send a slot twice) finds
    the entry due again within the slot: it sends that slot once. The next slot is sent; a
    send that failed is sent again."""
    clock = [NOW]
    app = make_app()
    scheduler = _capture(app, report={
        "task": "app.report", "schedule": crontab(minute="*/5", nowfun=lambda: clock[0])})
    scheduler.apply_entry(scheduler.schedule["report"], producer=None)
    scheduler.apply_entry(scheduler.schedule["report"], producer=None)
    assert [send["task_id"] for send in scheduler.sent] == [
        slot_task_id("report", "app.report", at(2024, 5, 1, 12, 5))]
    clock[0] = at(2024, 5, 1, 12, 10, 1)
    scheduler.apply_entry(scheduler.schedule["report"], producer=None)
    assert scheduler.sent[-1]["task_id"] == slot_task_id("report", "app.report",
                                                         at(2024, 5, 1, 12, 10))
    assert len(scheduler.sent) == 2

    failing = _Capture(app=app, schedule={})
    failing.fail = True
    failing.apply_entry(failing.schedule["report"], producer=None)  # logged by Celery's beat
    failing.fail = False
    failing.apply_entry(failing.schedule["report"], producer=None)
    assert [send["task_id"] for send in failing.sent] == [
        slot_task_id("report", "app.report", at(2024, 5, 1, 12, 10))]


def test_request_slot_reads_the_header() -> None:
    class Request:
        lease_slot = "2024-05-01T12:05:00+00:00"
        headers = None

    assert request_slot(Request()) == at(2024, 5, 1, 12, 5)
    assert request_slot(type("Plain", (), {"headers": None})()) is None


def test_an_explicit_task_id_is_kept_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    app = make_app()
    clock = [NOW]
    scheduler = _capture(app, pinned={"task": "app.report", "options": {"task_id": "fixed"},
                                      "schedule": crontab(nowfun=lambda: clock[0])})
    with caplog.at_level(logging.WARNING, logger="lease_celery.beat"):
        for minute in (7, 8):  # two slots (one beat sends a slot once)
            clock[0] = at(2024, 5, 1, 12, minute, 30)
            scheduler.apply_entry(scheduler.schedule["pinned"], producer=None)
    assert [s["task_id"] for s in scheduler.sent] == ["fixed", "fixed"]
    warnings = [r.getMessage() for r in caplog.records
                if r.name == "lease_celery.beat" and "'pinned'" in r.getMessage()]
    assert len(warnings) == 1 and "task_id='fixed'" in warnings[0]


class _Sunset(BaseSchedule):  # type: ignore[misc]
    """A schedule with a rule of its own (like ``solar``): no slot rule."""

    def is_due(self, last_run_at: datetime) -> Any:
        return schedstate(True, 60.0)

    def __repr__(self) -> str:
        return "<sunset>"


class _Shift(BaseSchedule):  # type: ignore[misc]
    """A custom schedule that names its own slots."""

    def is_due(self, last_run_at: datetime) -> Any:
        return schedstate(True, 60.0)

    def lease_slot(self, now: datetime) -> datetime:
        return now.replace(hour=6 if now.hour < 14 else 14, minute=0, second=0, microsecond=0)


def test_a_schedule_without_a_slot_rule_is_sent_as_celery_does(
        caplog: pytest.LogCaptureFixture) -> None:
    """No task id and no header are added (Celery gives each send a fresh id); one warning
    names the entry and says what that costs. A schedule with ``lease_slot(now)`` is slotted
    by it."""
    app = make_app()
    scheduler = _capture(app, dusk={"task": "app.lights", "schedule": _Sunset()},
                         shift={"task": "app.handover", "schedule": _Shift(nowfun=lambda: NOW)})
    with caplog.at_level(logging.WARNING, logger="lease_celery.beat"):
        for _ in range(2):
            scheduler.apply_entry(scheduler.schedule["dusk"], producer=None)
    assert all("task_id" not in s and "lease_slot" not in s["headers"] for s in scheduler.sent)
    warnings = [r.getMessage() for r in caplog.records if r.name == "lease_celery.beat"]
    assert len(warnings) == 1
    assert "'dusk'" in warnings[0] and "_Sunset" in warnings[0] and "N times" in warnings[0]
    with pytest.raises(NotSlotted, match="_Sunset"):
        slot_of(_Sunset(), NOW)
    scheduler.sent.clear()
    scheduler.apply_entry(scheduler.schedule["shift"], producer=None)
    assert scheduler.sent[0]["headers"]["lease_slot"] == at(2024, 5, 1, 6).isoformat()


def test_a_crontab_subclass_keeps_the_crontab_rule() -> None:
    assert slot_of(_Every5Minutes(minute="*/5", app=make_app()), NOW) == at(2024, 5, 1, 12, 5)


# -- composition -----------------------------------------------------------------------------

class _ModelEntry(ScheduleEntry):  # type: ignore[misc]
    """Shaped like django-celery-beat's ``ModelEntry``: ``is_due`` gates on the row before
    asking the schedule, and ``next()`` builds a fresh entry whose schedule is a new plain
    object read from the row."""

    enabled = True

    def is_due(self) -> Any:
        if not self.enabled:
            return schedstate(False, 5.0)
        return self.schedule.is_due(self.last_run_at)

    def __next__(self) -> _ModelEntry:
        return _ModelEntry(name=self.name, task=self.task, app=self.app,
                           schedule=schedule(self.schedule.run_every, nowfun=self.schedule.nowfun),
                           last_run_at=self.default_now())


class _DatabaseScheduler(Scheduler):  # type: ignore[misc]
    Entry = _ModelEntry

    def reserve(self, entry: Any) -> Any:
        new_entry = self.schedule[entry.name] = next(entry)
        return new_entry


class _RedBeatScheduler(Scheduler):  # type: ignore[misc]
    """Shaped like redbeat's: its own loop asks ``entry.is_due()`` in ``maybe_due`` and sends
    with ``apply_async(entry)``, which reserves (``advance=True``)."""

    def maybe_due(self, entry: Any, **kwargs: Any) -> Any:
        is_due, next_time_to_run = entry.is_due()
        if is_due:
            self.apply_async(entry, **kwargs)
        return next_time_to_run


class _Django(LeasedSchedulerMixin, _DatabaseScheduler):
    send_task = _Capture.send_task


class _RedBeat(LeasedSchedulerMixin, _RedBeatScheduler):
    send_task = _Capture.send_task


def _clock(start: datetime) -> tuple[list[datetime], Callable[[], datetime]]:
    now = [start]
    return now, lambda: now[0]


def test_mixin_on_a_django_shaped_scheduler() -> None:
    """Every fresh entry is aligned when Celery's loop asks ``Scheduler.is_due``; the entry's
    own gate (disabled) still answers first."""
    now, clock = _clock(at(2024, 5, 1, 12, 0, 0, 300_000))
    app = make_app()
    scheduler = _Django(app=app, schedule={})
    entry = _ModelEntry(name="sync", task="app.sync", app=app,
                        schedule=schedule(10.0, nowfun=clock), last_run_at=now[0])
    scheduler.schedule["sync"] = entry
    due, delay = scheduler.is_due(entry)
    assert (due, delay) == (False, pytest.approx(9.7))  # the 12:00:10 boundary, not +10 s
    now[0] = at(2024, 5, 1, 12, 0, 10, 2000)
    assert scheduler.is_due(entry)[0]
    fresh = scheduler.reserve(entry)
    assert type(fresh.schedule) is schedule  # the row's own object, aligned on first use:
    assert scheduler.is_due(fresh) == (False, pytest.approx(10 - 0.002))
    scheduler.apply_entry(fresh, producer=None)
    assert scheduler.sent[0]["task_id"] == slot_task_id("sync", "app.sync",
                                                        at(2024, 5, 1, 12, 0, 10))
    fresh.enabled = False
    assert scheduler.is_due(fresh) == (False, 5.0)


def test_mixin_on_a_redbeat_shaped_scheduler() -> None:
    """redbeat loads each entry afresh and asks ``entry.is_due()`` itself: ``maybe_due``
    aligns it first; its ``apply_async`` reserves, and the next entry keeps the alignment
    (redbeat stores its due time from it)."""
    now, clock = _clock(at(2024, 5, 1, 12, 0, 0, 300_000))
    app = make_app()
    scheduler = _RedBeat(app=app, schedule={})
    entry = scheduler.add(name="sync", task="app.sync", schedule=schedule(10.0, nowfun=clock),
                          last_run_at=now[0])
    assert scheduler.maybe_due(entry, producer=None) == pytest.approx(9.7)
    now[0] = at(2024, 5, 1, 12, 0, 10, 1000)
    assert scheduler.maybe_due(entry, producer=None) == pytest.approx(10 - 0.001)
    assert scheduler.sent[0]["task_id"] == slot_task_id("sync", "app.sync",
                                                        at(2024, 5, 1, 12, 0, 10))
    stored = scheduler.schedule["sync"]
    assert stored is not entry and stored.last_run_at == now[0]
    assert isinstance(stored.schedule, AlignedInterval)


def test_leased_scheduler_schedule_file_holds_the_plain_interval(tmp_path: Path) -> None:
    """After a LeasedScheduler synced its shelve file, the file holds Celery's own interval
    (a beat without lease_celery reads it), and Celery's PersistentScheduler opens it."""
    app = make_app()
    app.conf.beat_schedule = {"tick": {"task": "app.tick", "schedule": 5.0}}
    filename = str(tmp_path / "beat-schedule")
    leased = LeasedScheduler(app=app, schedule_filename=filename)
    leased.populate_heap()
    assert isinstance(leased.schedule["tick"].schedule, AlignedInterval)
    leased.close()
    with shelve.open(filename) as stored:
        assert type(stored["entries"]["tick"].schedule) is schedule
    plain = PersistentScheduler(app=app, schedule_filename=filename)
    try:
        assert plain.schedule["tick"].schedule.run_every == timedelta(seconds=5)
    finally:
        plain.close()


# -- the doctor check --------------------------------------------------------------------------

def _doctor_app(sqlite_url: str, beat_schedule: dict[str, Any]) -> Celery:
    app = Celery("beat-doctor", broker="redis://127.0.0.1:6379/11", set_as_current=False)
    app.conf.update(task_acks_late=True, task_reject_on_worker_lost=True,
                    worker_prefetch_multiplier=1, task_time_limit=600,
                    broker_transport_options={"visibility_timeout": 3600},
                    task_default_priority=5,  # recovered work ahead of new work (Redis)
                    lease_store_url=sqlite_url, lease_ttl=30, beat_schedule=beat_schedule)

    @app.task(base=LeasedTask, bind=True, shared=False, name="report",
              lease_key="report:{report_id}")
    def report(self: LeasedTask, report_id: Any) -> None:
        return None

    @app.task(base=LeasedTask, bind=True, shared=False, name="by_id")
    def by_id(self: LeasedTask, n: int = 0) -> None:
        return None

    @app.task(base=LeasedTask, bind=True, shared=False, name="constant_callable",
              lease_key=lambda n: "always")
    def constant_callable(self: LeasedTask, n: int) -> None:
        return None

    @app.task(shared=False, name="plain")
    def plain(report_id: int) -> None:
        return None

    return app


def test_doctor_warns_about_periodic_entries_that_cannot_run_once_per_slot(
        sqlite_url: str) -> None:
    """A key over fixed arguments (format string or callable), a fixed task_id used as the
    key, a key the entry's arguments cannot fill and a schedule with no slot rule are each
    named with the entry; SLOT or a lazy argument in the key, the default key, and plain
    tasks are not."""
    every = crontab(minute="*/5")
    app = _doctor_app(sqlite_url, {
        "fixed-report": {"task": "report", "schedule": every, "kwargs": {"report_id": 42}},
        "slotted-report": {"task": "report", "schedule": every, "kwargs": {"report_id": SLOT}},
        "lazy-report": {"task": "report", "schedule": every,
                        "kwargs": {"report_id": BeatLazyFunc(time.time)}},
        "default-key": {"task": "by_id", "schedule": 60.0},
        "pinned-id": {"task": "by_id", "schedule": 60.0, "options": {"task_id": "x"}},
        "constant-callable": {"task": "constant_callable", "schedule": 60.0, "args": (1,)},
        "missing-argument": {"task": "report", "schedule": every},
        "sunset": {"task": "by_id", "schedule": _Sunset()},
        "plain-task": {"task": "plain", "schedule": every, "kwargs": {"report_id": 1}},
    })
    findings = [f for f in diagnose(app) if f.code.startswith("beat.")]
    named = {(f.code, f.message.split("'")[1]) for f in findings}
    assert named == {("beat.lease_key_constant", "fixed-report"),
                     ("beat.task_id_fixed", "pinned-id"),
                     ("beat.lease_key_constant", "constant-callable"),
                     ("beat.lease_key_unresolvable", "missing-argument"),
                     ("beat.schedule_unslotted", "sunset")}
    assert {(f.severity, f.promise) for f in findings} == {("warning", "ownership")}
    fixed = next(f for f in findings if "fixed-report" in f.message)
    assert "'report:{report_id}'" in fixed.message and "'report:42'" in fixed.message
    assert "runs once" in fixed.message and "SLOT" in fixed.message
    assert not any(f.code == "ownership.ok" for f in diagnose(app))


def test_doctor_is_silent_about_a_sound_beat_schedule(sqlite_url: str) -> None:
    app = _doctor_app(sqlite_url, {
        "slotted": {"task": "report", "schedule": 300.0, "kwargs": {"report_id": SLOT}},
        "default": {"task": "by_id", "schedule": crontab()}})
    assert {f.code for f in diagnose(app)} == {"delivery.ok", "ownership.ok", "worker.pool"}


def test_a_beat_logs_the_doctor_warning_once(caplog: pytest.LogCaptureFixture,
                                            sqlite_url: str) -> None:
    app = _doctor_app(sqlite_url, {"fixed-report": {
        "task": "report", "schedule": crontab(nowfun=lambda: NOW), "kwargs": {"report_id": 7}}})
    scheduler = _Capture(app=app, schedule={})
    with caplog.at_level(logging.WARNING, logger="lease_celery.beat"):
        scheduler.populate_heap()
        scheduler.is_due(scheduler.schedule["fixed-report"])
    assert [r.getMessage().count("'report:7'") for r in caplog.records
            if r.name == "lease_celery.beat"] == [1]


# -- real beat processes -----------------------------------------------------------------------

BEAT_DB = int(os.environ.get("LEASE_TEST_BEAT_REDIS_DB", "7"))
BEAT_BROKER = f"redis://{REDIS_HOST}:{REDIS_PORT}/{BEAT_DB}"
PERIOD = timedelta(seconds=1)
#: Slots every beat must have sent before the beats are stopped.
SLOTS = 11


@dataclass
class BeatRig:
    """One real worker (module-wide) and the beats each test starts against it."""

    tmp: Path
    env: dict[str, str]
    journal: Journal
    worker: Worker
    beats: list[Worker] = field(default_factory=list)
    #: The Celery app module the beats run.
    beat_app: ClassVar[str] = "tests.support.beat_app"

    def start_beat(self, name: str, scheduler: str, entry: str,
                   extra_env: dict[str, str] | None = None) -> Worker:
        log = self.tmp / f"beat-{name}.log"
        env = {**os.environ, **self.env, **(extra_env or {}), "LEASE_TEST_BEAT_ROLE": "beat",
               "LEASE_TEST_BEAT_ENTRY": entry,
               "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
        cmd = [sys.executable, "-m", "celery", "-A", self.beat_app, "beat", "-S", scheduler,
               "-s", str(self.tmp / f"{name}.schedule"), "-l", "info"]
        with log.open("wb") as out:
            process = subprocess.Popen(cmd, cwd=self.tmp, env=env, stdout=out,
                                       stderr=subprocess.STDOUT, start_new_session=True)
        beat = Worker(name, process, log)
        self.beats.append(beat)
        return beat

    def logs(self) -> str:
        return "\n".join(f"----- {p.name} -----\n{p.output()}"
                         for p in [self.worker, *self.beats])


_Rig = TypeVar("_Rig", bound=BeatRig)


@contextlib.contextmanager
def running_rig(tmp_path_factory: pytest.TempPathFactory, broker: str, label: str,
                rig_class: type[_Rig], *, also_delete: str = "") -> Iterator[_Rig]:
    """A real worker running tests/support/beat_app.py on a queue, journal and SQLite store of this
    run's own (``label`` names them), in a rig of ``rig_class`` that starts beats; on the way
    out, the beats and the worker stop and every Redis key of the run is deleted (and those
    matching ``also_delete``, formatted with ``run``)."""
    client = redis.Redis.from_url(broker, socket_connect_timeout=2)
    try:
        client.ping()
    except redis.RedisError as exc:
        require("Redis", False, f"{broker}: {exc}")
    tmp = tmp_path_factory.mktemp(label)
    run = uuid.uuid4().hex[:8]
    env = {"LEASE_TEST_BEAT_BROKER": broker, "LEASE_TEST_BEAT_QUEUE": f"lease-{label}-{run}",
           "LEASE_TEST_BEAT_JOURNAL": f"lease-{label}-journal-{run}",
           "LEASE_TEST_BEAT_STORE": f"sqlite:///{tmp}/leases.sqlite3"}
    journal = Journal(client, env["LEASE_TEST_BEAT_JOURNAL"])
    log = tmp / "worker.log"
    cmd = [sys.executable, "-m", "celery", "-A", "tests.support.beat_app", "worker",
           "-P", "prefork", "-c", "2", "-n", f"{label}-{run}@%h", "--without-gossip",
           "--without-mingle", "--without-heartbeat", "-l", "info",
           "-Q", env["LEASE_TEST_BEAT_QUEUE"]]
    with log.open("wb") as out:
        process = subprocess.Popen(
            cmd, cwd=tmp, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, **env,
                 "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])})
    rig = rig_class(tmp, env, journal, Worker("worker", process, log))
    try:
        journal.wait_for(lambda j: bool(j.events("worker_ready")) or process.poll() is not None,
                         timeout=30, what="the worker to be ready")
        assert process.poll() is None, f"the worker exited:\n{rig.worker.output()}"
        yield rig
    finally:
        for beat in rig.beats:
            beat.stop()
        rig.worker.stop()
        queue = env["LEASE_TEST_BEAT_QUEUE"]
        keys = [env["LEASE_TEST_BEAT_JOURNAL"], *client.scan_iter(f"*{queue}*")]
        if also_delete:
            keys += client.scan_iter(also_delete.format(run=run))
        client.delete(*keys)


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BeatRig]:
    with running_rig(tmp_path_factory, BEAT_BROKER, "beat", BeatRig) as started:
        yield started


def _by_beat(sends: list[dict[str, Any]]) -> dict[int, list[str]]:
    slots: dict[int, list[str]] = {}
    for send in sends:
        slots.setdefault(send["pid"], []).append(send["slot"])
    return slots


def _judged(journal: Journal, entry: str) -> bool:
    """Every copy the beats sent has had its outcome: run, or dropped as already done."""
    ids = Counter(s["task_id"] for s in journal.events("sent", entry=entry))
    outcomes = Counter(e["task_id"] for e in journal.events()
                       if (e["event"] == "run" and e.get("entry") == entry)
                       or e["event"] in ("ignored", "completed"))
    return all(outcomes[task_id] >= n for task_id, n in ids.items())


def _run_beats(rig: BeatRig, count: int, scheduler: str, entry: str, *, slots: int) -> None:
    """Start ``count`` beats 0.7 s apart, wait until each sent ``slots`` times, stop them, and
    wait until the worker has judged every copy."""
    try:
        for index in range(count):
            if index:
                time.sleep(0.7)
            rig.start_beat(f"{entry}-{index}", scheduler, entry)
        rig.journal.wait_for(
            lambda j: len(_by_beat(j.events("sent", entry=entry))) == count
            and all(len(s) >= slots for s in _by_beat(j.events("sent", entry=entry)).values()),
            timeout=slots + 25, what=f"{count} beats to send {slots} times each")
    finally:
        for beat in rig.beats:
            beat.stop()
    rig.journal.wait_for(lambda j: _judged(j, entry), timeout=20,
                         what="the worker to judge every copy sent")


@pytest.mark.worker
@pytest.mark.parametrize("beats", [3])  # two beats are the smaller case of three (14 s saved)
def test_every_slot_runs_once_with_several_beats(rig: BeatRig, beats: int) -> None:
    """``beats`` real beats, started 0.7 s apart, all send every 1 s slot, on its boundary and
    under its slot's id; the worker runs each slot exactly once: runs == slots from the first
    to the last, none missed, none twice."""
    entry = f"tick-{beats}-{uuid.uuid4().hex[:6]}"
    try:
        _run_beats(rig, beats, "lease_celery.beat:LeasedScheduler", entry, slots=SLOTS)
        sends = rig.journal.events("sent", entry=entry)
        runs = rig.journal.events("run", entry=entry)
        by_beat = _by_beat(sends)
        assert len(by_beat) == beats
        for slots_sent in by_beat.values():  # no beat sends a slot twice
            assert len(slots_sent) == len(set(slots_sent))
        every_beat = set.intersection(*(set(s) for s in by_beat.values()))
        assert len(every_beat) >= SLOTS - 1  # copies of the same slot really were sent
        for send in sends:
            slot = datetime.fromisoformat(send["slot"])
            assert send["header"] == send["slot"]
            assert send["task_id"] == slot_task_id(entry, "beat_tick", slot)
        # On the boundary, whenever the beat started: the median lag is milliseconds.
        lags = [s["t"] - datetime.fromisoformat(s["slot"]).timestamp() for s in sends]
        assert statistics.median(lags) < 0.25, sorted(lags)

        ran = Counter(run["slot"] for run in runs)
        assert [slot for slot, n in ran.items() if n > 1] == []  # none twice
        first, last = (datetime.fromisoformat(s) for s in (min(ran), max(ran)))
        expected = {(first + k * PERIOD).isoformat()
                    for k in range(int((last - first) / PERIOD) + 1)}
        assert set(ran) == expected  # none missed
        assert len(runs) == len(expected) >= SLOTS
        assert set(ran) == {s["slot"] for s in sends}
        assert all(run["header"] == run["slot"] for run in runs)  # the body sees its slot
    except AssertionError:
        print(rig.logs())
        raise


@pytest.mark.worker
def test_without_the_leased_scheduler_every_beat_runs_every_tick(rig: BeatRig) -> None:
    """The failure this fixes: with Celery's PersistentScheduler each beat sends its own fresh
    id, so the same LeasedTask runs once per beat per tick."""
    entry = f"plain-{uuid.uuid4().hex[:6]}"
    try:
        _run_beats(rig, 2, "celery.beat:PersistentScheduler", entry, slots=5)
        sends = rig.journal.events("sent", entry=entry)
        runs = rig.journal.events("run", entry=entry)
        assert {s["slot"] for s in sends} == {SLOT}  # no slot, no header: plain Celery
        assert len({s["task_id"] for s in sends}) == len(sends)
        assert sorted(r["task_id"] for r in runs) == sorted(s["task_id"] for s in sends)
        sent_at = {s["task_id"]: s["t"] for s in sends}
        per_second = Counter(int(sent_at[r["task_id"]]) for r in runs)
        assert sum(1 for n in per_second.values() if n > 1) >= 3  # ticks that ran twice
    except AssertionError:
        print(rig.logs())
        raise
