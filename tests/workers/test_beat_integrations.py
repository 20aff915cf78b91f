"""``lease_celery.beat`` on the real third-party schedulers: redbeat and django-celery-beat.

Process tests: two real ``celery beat`` processes (started 0.7 s apart) and one real
``celery worker`` (prefork) on a Redis broker (database LEASE_TEST_BEAT_INTEGRATIONS_REDIS_DB,
7 by default, test_beat.py's: no test flushes it, every key is a run's own and deleted after;
5 was one of the databases tests/support/servers.py gives pytest-xdist workers, which a run
flushes) and a SQLite lease store, a 1 s interval entry, the app of
tests/support/beat_app.py (tests/support/beat_integrations_app.py configures it for each scheduler):

* redbeat, ``lease_celery.beat:LeasedRedBeatScheduler``: one schedule in Redis under a key
  prefix of this run, shared by both beats, with redbeat's lock off (``redbeat_lock_key=None``,
  what a highly available pair runs with, and what a lock that fails open amounts to); redbeat's
  Redis is reached through a proxy adding 5 ms each way, and the max loop interval (0.5 s) is
  below the period, as it is for any entry longer than 5 minutes on Celery's default. The two
  beats then wake at the same instant and both read the entry before either has stored its
  ``last_run_at``: with redbeat's own ``RedBeatScheduler`` such a tick runs twice.
* django-celery-beat, ``lease_celery.beat:LeasedDatabaseScheduler``: a Django project of
  django_celery_beat only (tests/support/beat_django/settings.py) on a SQLite file migrated here, an
  IntervalSchedule and a PeriodicTask created through the ORM. Each beat keeps its own
  ``last_run_at`` in memory (written back every 3 minutes), so with django-celery-beat's own
  ``DatabaseScheduler`` every beat runs every tick.

Without processes: the ready-made classes and their import error, django-celery-beat's model
schedules (its interval, its ``TzAwareCrontab``, ``clocked``) as ``ModelEntry`` builds them,
and redbeat's JSON storage of the aligned interval.

The packages come with the ``test`` extra: missing, the module fails under CI and is skipped
elsewhere.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import statistics
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from celery import Celery
from celery.schedules import schedule

from lease_celery import LeasedTask
from lease_celery.beat import SLOT, AlignedInterval, NotSlotted, slot_of, slot_task_id
from tests.support.proxy import CuttableProxy
from tests.support.servers import REDIS_HOST, REDIS_PORT
from tests.workers.test_beat import PERIOD, BeatRig, _by_beat, _judged, running_rig


def _third_party(module: str) -> Any:
    """Import a package of the test extra: fail under CI, skip elsewhere."""
    if os.environ.get("CI", "").lower() == "true":
        return __import__(module)
    return pytest.importorskip(module, reason=f"{module} is not installed: pip install -e . "
                               "--group test")


_third_party("redbeat")
_third_party("django_celery_beat")

UTC = timezone.utc
DB = int(os.environ.get("LEASE_TEST_BEAT_INTEGRATIONS_REDIS_DB", "7"))
BROKER = f"redis://{REDIS_HOST}:{REDIS_PORT}/{DB}"
#: Slots the beats must have sent before they are stopped.
SLOTS = 11
#: Added each way to redbeat's Redis round trips (a Redis a few milliseconds away).
REDBEAT_LATENCY = 0.005
LEASED_REDBEAT = "lease_celery.beat:LeasedRedBeatScheduler"
LEASED_DJANGO = "lease_celery.beat:LeasedDatabaseScheduler"


class IntegrationRig(BeatRig):
    """tests/workers/test_beat.py's rig, with beats of tests/support/beat_integrations_app.py."""

    beat_app = "tests.support.beat_integrations_app"


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[IntegrationRig]:
    with running_rig(tmp_path_factory, BROKER, "beatx", IntegrationRig,
                     also_delete="lease-redbeat-{run}*") as started:
        yield started


def _run_beats(rig: IntegrationRig, scheduler: str, entry: str, extra_env: dict[str, str],
               done: Callable[[list[dict[str, Any]]], bool], *, timeout: float) -> None:
    """Start two beats 0.7 s apart, wait until their sends satisfy ``done``, stop them, and
    wait until the worker has judged every copy they sent."""
    try:
        for index in range(2):
            if index:
                time.sleep(0.7)
            rig.start_beat(f"{entry}-{index}", scheduler, entry, extra_env)
        rig.journal.wait_for(lambda j: done(j.events("sent", entry=entry)), timeout=timeout,
                             what=f"the beats of {entry} to send")
    finally:
        for beat in rig.beats:
            beat.stop()
    rig.journal.wait_for(lambda j: _judged(j, entry), timeout=20,
                         what="the worker to judge every copy sent")


def _every_beat_sent(slots: int) -> Callable[[list[dict[str, Any]]], bool]:
    def done(sends: list[dict[str, Any]]) -> bool:
        by_beat = _by_beat(sends)
        return len(by_beat) == 2 and all(len(s) >= slots for s in by_beat.values())
    return done


def _slots_sent(slots: int) -> Callable[[list[dict[str, Any]]], bool]:
    """Both beats sent, and ``slots`` slots were sent between them (each redbeat beat sends
    a slot only if it read the entry before the other stored its run)."""
    def done(sends: list[dict[str, Any]]) -> bool:
        return len(_by_beat(sends)) == 2 and len({s["slot"] for s in sends}) >= slots
    return done


def _assert_each_slot_ran_once(rig: IntegrationRig, entry: str, *, shared: int) -> None:
    """Every send carries its slot's id and header; at least ``shared`` slots were sent by
    both beats; the worker ran each slot exactly once: runs == slots from the first to the
    last, none missed, none twice."""
    sends = rig.journal.events("sent", entry=entry)
    runs = rig.journal.events("run", entry=entry)
    by_beat = _by_beat(sends)
    assert len(by_beat) == 2
    for slots_sent in by_beat.values():
        assert len(slots_sent) == len(set(slots_sent))  # no beat sends a slot twice
    both = set.intersection(*(set(s) for s in by_beat.values()))
    assert len(both) >= shared, sorted(both)  # copies of one slot really were sent
    for send in sends:
        slot = datetime.fromisoformat(send["slot"])
        assert send["header"] == send["slot"]
        assert send["task_id"] == slot_task_id(entry, "beat_tick", slot)
    lags = [s["t"] - datetime.fromisoformat(s["slot"]).timestamp() for s in sends]
    assert statistics.median(lags) < 0.25, sorted(lags)  # on the boundary

    ran = Counter(run["slot"] for run in runs)
    assert [slot for slot, n in ran.items() if n > 1] == []  # none twice
    first, last = (datetime.fromisoformat(s) for s in (min(ran), max(ran)))
    expected = {(first + k * PERIOD).isoformat() for k in range(int((last - first) / PERIOD) + 1)}
    assert set(ran) == expected  # none missed
    assert len(runs) == len(expected) >= SLOTS
    assert set(ran) == {s["slot"] for s in sends}
    assert all(run["header"] == run["slot"] for run in runs)
    print(f"{entry}: {len(expected)} slots, {len(runs)} runs, {len(sends)} sends, "
          f"{len(both)} slots sent by both beats")


def _assert_ticks_ran_twice(rig: IntegrationRig, entry: str) -> None:
    """Plain Celery sends: no slot, a fresh id per copy, every copy runs, and several
    seconds had two runs of the 1 s entry."""
    sends = rig.journal.events("sent", entry=entry)
    sent_at = {s["task_id"]: s["t"] for s in sends}
    runs = rig.journal.events("run", entry=entry)
    assert {s["slot"] for s in sends} == {SLOT}
    assert len(sent_at) == len(sends)
    # Every copy sent ran, once. A beat is stopped (SIGTERM) right after a send: its last
    # copy may be published and run with its "sent" entry never written (the entry follows
    # the publish), so at most one run per beat has no entry (seen once in CI).
    ran = [r["task_id"] for r in runs if r["task_id"] in sent_at]
    assert sorted(ran) == sorted(sent_at)
    assert len(runs) - len(ran) <= 2, [r for r in runs if r["task_id"] not in sent_at]  # 2 beats
    per_second = Counter(int(sent_at[task_id]) for task_id in ran)
    twice = sum(1 for n in per_second.values() if n > 1)
    assert twice >= 3, sorted(per_second.items())
    print(f"{entry}: {len(sends)} sends, {len(runs)} runs over {len(per_second)} seconds, "
          f"{twice} of them with two runs")


def test_the_ready_made_schedulers_are_built_on_first_use(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``-S lease_celery.beat:LeasedRedBeatScheduler`` names one class, the mixin first; a
    missing package is an ImportError that says what to install."""
    from celery.utils.imports import symbol_by_name
    from redbeat import RedBeatScheduler

    from lease_celery import beat

    made = symbol_by_name(LEASED_REDBEAT)
    assert made is beat.LeasedRedBeatScheduler
    assert made.__mro__[1:3] == (beat.LeasedSchedulerMixin, RedBeatScheduler)
    monkeypatch.setitem(sys.modules, "redbeat", None)  # as if not installed
    with pytest.raises(ImportError, match="pip install celery-redbeat"):
        beat.__getattr__("LeasedRedBeatScheduler")
    with pytest.raises(AttributeError, match="LeasedNothing"):
        beat.__getattr__("LeasedNothing")


# -- redbeat -----------------------------------------------------------------------------------

class _SlowProxy(CuttableProxy):
    """A proxy that holds every chunk ``REDBEAT_LATENCY`` seconds before passing it on."""

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                time.sleep(REDBEAT_LATENCY)
                sink.sendall(data)
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)


@pytest.fixture(scope="module")
def redbeat_url(rig: IntegrationRig) -> Iterator[str]:
    """redbeat's Redis (the broker's database), REDBEAT_LATENCY away."""
    proxy = _SlowProxy(REDIS_HOST, REDIS_PORT)
    try:
        yield f"redis://127.0.0.1:{proxy.port}/{DB}"
    finally:
        proxy.cut()


def _redbeat_env(rig: IntegrationRig, redbeat_url: str, entry: str) -> dict[str, str]:
    run = rig.env["LEASE_TEST_BEAT_QUEUE"].rsplit("-", 1)[1]
    return {"LEASE_TEST_BEAT_REDBEAT_URL": redbeat_url,
            "LEASE_TEST_BEAT_REDBEAT_PREFIX": f"lease-redbeat-{run}-{entry}:",
            "LEASE_TEST_BEAT_MAX_INTERVAL": "0.5"}


@pytest.mark.worker
def test_redbeat_without_its_lock_runs_every_slot_once(rig: IntegrationRig,
                                                       redbeat_url: str) -> None:
    """Two lock-less redbeat beats on one schedule both send most slots, under the slot's
    id; the worker runs each slot once: runs == slots, none missed, none twice."""
    entry = f"redbeat-{uuid.uuid4().hex[:6]}"
    try:
        _run_beats(rig, LEASED_REDBEAT, entry, _redbeat_env(rig, redbeat_url, entry),
                   _slots_sent(SLOTS + 1), timeout=SLOTS + 25)
        _assert_each_slot_ran_once(rig, entry, shared=3)
    except AssertionError:
        print(rig.logs())
        raise


@pytest.mark.worker
def test_plain_redbeat_without_its_lock_runs_ticks_twice(rig: IntegrationRig,
                                                         redbeat_url: str) -> None:
    """The control: redbeat's own scheduler, same conditions. Both beats read the entry
    before either stores its run, and each sends it under a fresh id: those ticks run twice."""
    entry = f"redbeat-plain-{uuid.uuid4().hex[:6]}"
    try:
        _run_beats(rig, "redbeat:RedBeatScheduler", entry, _redbeat_env(rig, redbeat_url, entry),
                   lambda sends: len({int(s["t"]) for s in sends}) >= 7, timeout=30)
        _assert_ticks_ran_twice(rig, entry)
    except AssertionError:
        print(rig.logs())
        raise


def test_redbeat_stores_the_aligned_interval_as_its_own_interval() -> None:
    """redbeat keeps an entry as JSON: the aligned interval is written as redbeat's
    ``interval`` and read back as Celery's plain one (a beat without lease_celery reads it).
    redbeat's ``rrule`` has no slot rule."""
    from redbeat.decoder import RedBeatJSONDecoder, RedBeatJSONEncoder
    from redbeat.schedules import rrule

    stored = json.dumps({"schedule": AlignedInterval(timedelta(seconds=30))},
                        cls=RedBeatJSONEncoder)
    assert json.loads(stored)["schedule"]["__type__"] == "interval"
    restored = json.loads(stored, cls=RedBeatJSONDecoder)["schedule"]
    assert type(restored) is schedule and restored.run_every == timedelta(seconds=30)
    with pytest.raises(NotSlotted, match="rrule"):
        slot_of(rrule("MINUTELY", dtstart=datetime(2024, 1, 1, tzinfo=UTC)),
                datetime(2024, 5, 1, tzinfo=UTC))


# -- django-celery-beat ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def django_db(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The SQLite file of tests/support/beat_django/settings.py, migrated; Django is set up in this
    process on it, so tests create schedules through the ORM."""
    import django
    from django.conf import settings
    from django.core.management import call_command

    from tests.support.beat_django import settings as project

    if not settings.configured:
        path = tmp_path_factory.mktemp("beat-django") / "django.sqlite3"
        fields = {name: getattr(project, name) for name in dir(project) if name.isupper()}
        fields["DATABASES"] = {"default": {**project.DATABASES["default"], "NAME": str(path)}}
        settings.configure(**fields)
        django.setup()
    call_command("migrate", verbosity=0, interactive=False)
    name: str = settings.DATABASES["default"]["NAME"]
    return name


def _periodic_task(name: str, **schedule_field: Any) -> Any:
    from django_celery_beat.models import PeriodicTask

    return PeriodicTask.objects.create(
        name=name, task="beat_tick", kwargs=json.dumps({"entry": name, "slot": SLOT}),
        **schedule_field)


def _interval_task(name: str) -> Any:
    from django_celery_beat.models import IntervalSchedule

    every, _ = IntervalSchedule.objects.get_or_create(every=1, period=IntervalSchedule.SECONDS)
    return _periodic_task(name, interval=every)


def _django_beats(rig: IntegrationRig, django_db: str, scheduler: str, entry: str,
                  slots: int) -> None:
    from django.db import connection
    from django_celery_beat.models import PeriodicTask

    _interval_task(entry)
    connection.close()  # the beats write to the file too
    try:
        _run_beats(rig, scheduler, entry, {"LEASE_TEST_BEAT_DJANGO_DB": django_db},
                   _every_beat_sent(slots), timeout=slots + 25)
    finally:
        PeriodicTask.objects.filter(name=entry).delete()  # the next test's beats load the rest


@pytest.mark.worker
def test_django_celery_beat_runs_every_slot_once(rig: IntegrationRig, django_db: str) -> None:
    """Two beats on django-celery-beat's DatabaseScheduler with the mixin, a PeriodicTask
    made through the ORM: each beat sends every slot under the slot's id, on its boundary;
    the worker runs each slot once: runs == slots, none missed, none twice."""
    entry = f"django-{uuid.uuid4().hex[:6]}"
    try:
        _django_beats(rig, django_db, LEASED_DJANGO, entry, SLOTS)
        _assert_each_slot_ran_once(rig, entry, shared=SLOTS - 1)
    except AssertionError:
        print(rig.logs())
        raise


@pytest.mark.worker
def test_plain_django_celery_beat_runs_every_tick_once_per_beat(rig: IntegrationRig,
                                                               django_db: str) -> None:
    """The control: django-celery-beat's own DatabaseScheduler; each beat sends every tick
    under a fresh id, and each copy runs."""
    entry = f"django-plain-{uuid.uuid4().hex[:6]}"
    try:
        _django_beats(rig, django_db, "django_celery_beat.schedulers:DatabaseScheduler",
                      entry, 5)
        _assert_ticks_ran_twice(rig, entry)
    except AssertionError:
        print(rig.logs())
        raise


def test_django_model_schedules_have_their_slots(django_db: str,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    """The schedules ModelEntry builds from the rows, in a real LeasedDatabaseScheduler: the
    interval is aligned when the scheduler first asks it, and a row whose lease_key is the
    same in every slot gets the doctor's warning in the beat's log (``celery leases doctor``
    reads only ``beat_schedule``); ``TzAwareCrontab`` (in the row's timezone, across a DST
    change) gets each of its own fire times as its slot; ``clocked`` has no slot rule (nor has
    ``solar``, whose rows need the ``ephem`` package)."""
    from zoneinfo import ZoneInfo

    from django_celery_beat.models import (
        ClockedSchedule,
        CrontabSchedule,
        PeriodicTask,
    )
    from django_celery_beat.schedulers import ModelEntry

    from lease_celery.beat import LeasedDatabaseScheduler

    tag = uuid.uuid4().hex[:6]
    app = Celery("beat-django-units", set_as_current=False)

    @app.task(base=LeasedTask, bind=True, shared=False, name="beat_tick",  # type: ignore[untyped-decorator]
              lease_key="tick:{entry}")
    def tick(self: LeasedTask, entry: str, slot: str) -> None:
        return None

    _interval_task(f"every-{tag}")
    scheduler = LeasedDatabaseScheduler(app=app)
    try:
        interval = scheduler.schedule[f"every-{tag}"]
        assert type(interval.schedule) is schedule  # as the row makes it
        with caplog.at_level(logging.WARNING, logger="lease_celery.beat"):
            scheduler.is_due(interval)
        assert isinstance(interval.schedule, AlignedInterval)
        assert [r.getMessage().count(f"'tick:every-{tag}' in every slot") for r in caplog.records
                if r.name == "lease_celery.beat"] == [1]

        # Straight from the rows: the scheduler leaves out crontabs whose hour is not near
        # now, and clocked times more than 5 minutes away.
        paris = CrontabSchedule.objects.create(minute="0", hour="9",
                                               timezone=ZoneInfo("Europe/Paris"))
        cron = ModelEntry(_periodic_task(f"paris-{tag}", crontab=paris), app=app).schedule
        assert type(cron).__name__ == "TzAwareCrontab"
        fires, last = [], datetime(2024, 3, 29, 12, tzinfo=UTC)  # Paris: summer time on the 31st
        for _ in range(3):
            fires.append(last := _first_due(cron, last))
            assert slot_of(cron, last) == slot_of(cron, last + timedelta(seconds=59)) == last
        assert fires == [datetime(2024, 3, 30, 8, tzinfo=UTC),  # 09:00 CET
                         datetime(2024, 3, 31, 7, tzinfo=UTC),  # 09:00 CEST
                         datetime(2024, 4, 1, 7, tzinfo=UTC)]

        clocked = ClockedSchedule.objects.create(clocked_time=datetime(2030, 1, 1, tzinfo=UTC))
        once = ModelEntry(_periodic_task(f"clocked-{tag}", clocked=clocked, one_off=True),
                          app=app)
        with pytest.raises(NotSlotted, match="clocked"):
            slot_of(once.schedule, datetime(2024, 5, 1, tzinfo=UTC))
    finally:
        scheduler.close()
        PeriodicTask.objects.filter(name__endswith=tag).delete()


def _first_due(cron: Any, last_run_at: datetime) -> datetime:
    """The first whole minute after ``last_run_at`` at which the schedule's own ``is_due``
    says due: when a beat fires it."""
    now = last_run_at
    while True:
        now += timedelta(minutes=1)
        cron.nowfun = lambda moment=now: moment
        if cron.is_due(last_run_at)[0]:
            return now
