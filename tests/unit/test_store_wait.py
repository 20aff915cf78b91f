"""The wait of a delivery for an unavailable store (lease_celery.execution.outage), on a fake
clock: bounded by about a ttl, pauses that grow, a last try at the bound, and an end at
worker shutdown."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
from celery.worker import state as worker_state

from lease_celery import StoreDataLost, StoreError
from lease_celery.execution.outage import (
    FIRST_PAUSE,
    StoreWait,
    finish_waiting,
    retrying,
    wait_bound,
    worker_stopping,
)


class FakeTime:
    def __init__(self) -> None:
        self.now = 100.0
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def _task(timelimit: object = None, hard: float | None = None,
          soft: float | None = None) -> SimpleNamespace:
    return SimpleNamespace(request=SimpleNamespace(id="t", timelimit=timelimit),
                           time_limit=hard, soft_time_limit=soft)


def _wait(bound: float, fake: FakeTime, stopping: bool = False) -> StoreWait:
    """A wait of about ``bound`` (the ttl of a task without time limits)."""
    return StoreWait(_task(), bound, "k", clock=fake.clock, sleep=fake.sleep,
                     stopping=lambda: stopping)


def test_an_outage_longer_than_the_bound_gets_a_last_try_at_the_bound() -> None:
    fake = FakeTime()
    wait = _wait(2.0, fake)
    failures = []

    def claim() -> str:
        failures.append(fake.now)
        raise StoreError("refused")

    with pytest.raises(StoreError):
        retrying(claim, wait)
    assert failures[0] == 100.0 and failures[-1] == pytest.approx(102.0)
    assert wait.waited == pytest.approx(2.0)
    pauses = [b - a for a, b in itertools.pairwise(failures)]
    # Each pause from the upper half of one that doubles, up to a quarter of the bound.
    assert FIRST_PAUSE / 2 <= pauses[0] <= FIRST_PAUSE
    assert max(pauses) <= 0.5 + 1e-9
    assert "for 2.0s" in wait.reason(StoreError("refused"))


def test_the_bound_runs_from_the_first_failure_not_from_a_slow_first_try() -> None:
    """A try under way when the outage began (a stall, slow replies) fails late: the wait
    still gets its whole bound after that failure."""
    fake = FakeTime()
    wait = _wait(2.0, fake)
    failures = []

    def claim() -> str:
        if not failures:
            fake.now += 5.0  # the first try hung 5 s, then its connection was reset
        failures.append(fake.now)
        raise StoreError("reset")

    with pytest.raises(StoreError):
        retrying(claim, wait)
    assert failures[-1] - failures[0] == pytest.approx(2.0)
    assert wait.waited == pytest.approx(2.0)


def test_a_blip_ends_the_wait_with_the_first_try_that_is_answered() -> None:
    fake = FakeTime()
    wait = _wait(30.0, fake)
    answers = iter([StoreError("refused")] * 5 + ["lease"])

    def claim() -> str:
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    assert retrying(claim, wait) == "lease"
    assert wait.tries == 5 and wait.waited < 2.0


def test_a_shutdown_ends_the_wait_at_once() -> None:
    fake = FakeTime()
    wait = _wait(30.0, fake, stopping=True)
    with pytest.raises(StoreError):
        retrying(lambda: (_ for _ in ()).throw(StoreError("refused")), wait)
    assert fake.sleeps == [] and wait.interrupted
    assert wait.reason(StoreError("refused")).endswith("the worker is shutting down")


def test_without_a_wait_the_first_store_error_goes_to_the_caller() -> None:
    with pytest.raises(StoreError):
        retrying(lambda: (_ for _ in ()).throw(StoreError("refused")), None)


def test_a_store_that_lost_its_data_is_not_waited_for() -> None:
    """The store answered (its epoch is lost): only an operator changes that, so the first
    StoreDataLost goes to the caller, without a pause."""
    fake = FakeTime()
    tries = []

    def attempt() -> None:
        tries.append(fake.now)
        raise StoreDataLost("lost its data")

    with pytest.raises(StoreDataLost):
        retrying(attempt, _wait(30.0, fake))
    assert tries == [100.0] and fake.sleeps == []


@pytest.mark.parametrize(("flag", "value", "stopping"), [
    ("should_stop", None, False), ("should_stop", False, False),
    ("should_stop", 0, True),  # EX_OK: a warm shutdown's exit code
    ("should_terminate", True, True), ("should_terminate", 1, True)])
def test_worker_stopping_reads_celerys_shutdown_flags(
        monkeypatch: pytest.MonkeyPatch, flag: str, value: object, stopping: bool) -> None:
    monkeypatch.setattr(worker_state, "should_stop", None)
    monkeypatch.setattr(worker_state, "should_terminate", None)
    monkeypatch.setattr(worker_state, flag, value)
    assert worker_stopping() is stopping


def test_the_bound_is_a_ttl_and_at_most_half_a_time_limit() -> None:
    assert wait_bound(_task(), 30.0) == 30.0
    assert wait_bound(_task(hard=20.0), 30.0) == 10.0
    assert wait_bound(_task(timelimit=(None, 8.0), hard=20.0), 30.0) == 4.0
    assert wait_bound(_task(timelimit=(100.0, None)), 30.0) == 30.0


def test_a_wait_that_never_failed_read_no_clock() -> None:
    """Made for every delivery: nothing happens until a first failure."""
    wait = StoreWait(_task(), 30.0, "k", clock=lambda: pytest.fail("clock read"))
    assert retrying(lambda: "lease", wait) == "lease"
    assert wait.waited == 0.0 and wait.what == "delivery t of k"


class _FinishingStore:
    """A store whose finish answers from a script, and whose row says whose it is."""

    def __init__(self, *answers: object, ours: bool) -> None:
        self.answers, self.ours = list(answers), ours
        self.asked_whose = 0

    def finish(self, lease: object, result: object, *, settle_within: float | None) -> bool:
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return bool(answer)

    def settled_by(self, lease: object, state: object) -> bool:
        self.asked_whose += 1
        return self.ours


def test_a_finish_whose_reply_was_lost_is_found_on_the_row() -> None:
    """The first try landed but its reply was lost; the next is refused: the row, done with
    this lease's owner and token, says the finish was accepted."""
    fake = FakeTime()
    store = _FinishingStore(StoreError("reset"), False, ours=True)
    assert finish_waiting(store, object(), {"ok": 1}, settle_within=None,  # type: ignore[arg-type]
                          wait=_wait(2.0, fake))


def test_a_finish_refused_at_its_first_try_is_refused() -> None:
    fake = FakeTime()
    store = _FinishingStore(False, ours=True)
    assert not finish_waiting(store, object(), None, settle_within=None,  # type: ignore[arg-type]
                              wait=_wait(2.0, fake))
    assert store.asked_whose == 0
