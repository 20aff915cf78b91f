"""``outcome.decide`` as a table: what a body that raised leads to, exception by exception,
with the task's options. A LeasedTask keeps Celery's meaning of its own control flow and adds
only what the lease owns (a lost lease, a cancel, the opt-in error retries)."""

from __future__ import annotations

import datetime

import pytest
from celery.exceptions import Ignore, Reject, Retry, SoftTimeLimitExceeded

from lease_celery import LeaseLost
from lease_celery.execution.outcome import End, decide, retry_delay, retry_message
from lease_celery.policy import Policy

CELERY = Policy(max_attempts=3, max_takeovers=3, backoff_base=1.0, backoff_max=60.0)
RETRYING = Policy(max_attempts=3, max_takeovers=3, backoff_base=1.0, backoff_max=60.0,
                  retry_errors=True, permanent_errors=(ValueError,))
NOW = datetime.datetime(2026, 12, 6, 12, 0, tzinfo=datetime.timezone.utc)


@pytest.mark.parametrize(("exc", "options", "end", "reason"), [
    # Celery's semantics by default: an error fails at once, whatever lease_max_attempts says.
    (RuntimeError("boom"), {}, End.FAIL, "failed: RuntimeError('boom')"),
    (RuntimeError("boom"), {"attempts": 1}, End.FAIL, "failed"),
    # Celery's own control flow keeps its meaning.
    (Retry(when=5), {}, End.RETRY, "Retry in 5s"),
    (Retry(when=5), {"policy": RETRYING, "attempts": 3}, End.RETRY, "Retry in 5s"),
    (Reject("nope", requeue=False), {}, End.REJECTED, "rejected: 'nope'"),
    (Reject("again", requeue=True), {}, End.REQUEUED, "Reject(requeue=True)"),
    (Ignore(), {}, End.IGNORED, "ignored"),
    (Ignore("Replaced by new task"), {"replaced": True}, End.REPLACED, "replaced"),
    # What the lease owns.
    (SystemExit(1), {}, End.TERMINATED, "worker shutdown"),
    (KeyboardInterrupt(), {"cancelled": "cancelled: by hand"}, End.TERMINATED, "terminated"),
    (LeaseLost("gone"), {}, End.LOST, "LeaseLost"),
    (RuntimeError("late"), {"lost": True}, End.LOST, "RuntimeError"),
    (RuntimeError("x"), {"cancelled": "cancelled: by hand"}, End.CANCELLED, "cancelled: by hand"),
    (Retry(when=5), {"cancelled": "cancelled: by hand"}, End.CANCELLED, "cancelled"),
    # Time limits: one failure, unless the task retries them.
    (SoftTimeLimitExceeded(), {"soft_limit": 2}, End.FAIL, "soft time limit exceeded (2s)"),
    (SoftTimeLimitExceeded(), {"retry_time_limits": True}, End.BACKOFF, "attempt 1 failed"),
    (SoftTimeLimitExceeded(), {"retry_time_limits": True, "attempts": 3}, End.FAIL,
     "3 attempts exhausted"),
    # Celery's retries of this error are spent: final, whatever the lease would do.
    (RuntimeError("x"), {"celery_retries_exhausted": True, "policy": RETRYING}, End.FAIL,
     "Celery's max_retries exhausted"),
    (RuntimeError("x"), {"autoretry_for": (RuntimeError,), "policy": RETRYING}, End.FAIL,
     "after Celery's retries"),
    # lease_retry_errors: backoff until lease_max_attempts, permanent errors at once.
    (RuntimeError("x"), {"policy": RETRYING, "attempts": 2}, End.BACKOFF, "attempt 2 failed"),
    (RuntimeError("x"), {"policy": RETRYING, "attempts": 3}, End.FAIL, "3 attempts exhausted"),
    (ValueError("x"), {"policy": RETRYING}, End.FAIL, "permanent error"),
])
def test_decide(exc: BaseException, options: dict, end: End, reason: str) -> None:
    arguments = {"policy": CELERY, "attempts": 1, "now": NOW, **options}
    outcome = decide(exc, **arguments)
    assert outcome.end is end
    assert reason in outcome.reason


def test_a_backoff_grows_within_the_policy_and_an_eager_one_is_immediate() -> None:
    """The opt-in retries wait the policy's backoff (equal jitter: half to all of the
    ceiling); an eager call runs its retry at once, as Celery does."""
    second = decide(RuntimeError("x"), policy=RETRYING, attempts=2)
    assert 1.0 <= second.delay <= 2.0
    eager = decide(RuntimeError("x"), policy=RETRYING, attempts=2, eager=True)
    assert eager.delay == 0.0


def test_a_retry_is_due_at_its_countdown_or_its_eta() -> None:
    """A countdown is the delay; an eta is measured from now (a naive eta is UTC, as Celery
    reads it); one in the past is due at once."""
    assert retry_delay(Retry(when=7.5)) == 7.5
    eta = NOW + datetime.timedelta(seconds=90)
    assert retry_delay(Retry(when=eta), now=NOW) == 90.0
    assert retry_delay(Retry(when=eta.replace(tzinfo=None)), now=NOW) == 90.0
    assert retry_delay(Retry(when=NOW - datetime.timedelta(seconds=5)), now=NOW) == 0.0
    assert decide(Retry(when=eta), policy=CELERY, attempts=1, now=NOW).delay == 90.0


def test_the_retry_message_is_the_retry_without_its_countdown() -> None:
    """The row records the retry's own message (its ``retries`` count), without the countdown
    or eta: the row's ``not_before`` says when it is due."""
    sig = {"task": "proj.t", "args": [1], "kwargs": {},
           "options": {"task_id": "tid", "retries": 2, "countdown": 30, "eta": None},
           "subtask_type": None, "immutable": False}
    message = retry_message(Retry(when=30, sig=sig))
    assert message is not None
    assert message["options"] == {"task_id": "tid", "retries": 2}
    assert retry_message(Retry(when=30)) is None
