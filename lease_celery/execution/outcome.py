"""What a body that raised leads to: one pure decision over the exception and the task's options.

A LeasedTask does what the same plain Celery task does, except where the lease makes a promise
(one accepted outcome per key; a stale outcome refused). So Celery's own control flow keeps
its meaning: a ``Retry`` runs when Celery scheduled it, with its message; ``Reject`` and
``Ignore`` end the key, never re-run; ``replace()`` hands the key on; an exception fails the
task at once unless the task asks for retries. The lease adds only what it owns: a lost lease
is never the task's failure, an operator's cancel ends the key, and the opt-in error retries
(``lease_retry_errors``). ``decide`` reads nothing but its arguments, so the whole table is
tested without a worker; ``ending.Ending`` applies what it returns.
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from celery.exceptions import Ignore, Reject, Retry, SoftTimeLimitExceeded
from celery.utils.time import maybe_make_aware

from ..errors import LeaseLost
from ..policy import Outcome as PolicyVerdict
from ..policy import Policy

__all__ = ["End", "Outcome", "decide", "retry_delay", "retry_message"]


class End(enum.Enum):
    """How an attempt that raised ends, and so what is written to the key's row."""

    #: An operator cancelled the key: dead with the cancel's reason, never retried.
    CANCELLED = "cancelled"
    #: Celery's ``self.retry()``: ready again when the retry is due, the retry's message on
    #: the row, the attempt given back (the task's own control flow).
    RETRY = "retry"
    #: ``replace()``: the key was handed to the replacement (or, if the replacement runs on
    #: no lease of this key, it is done, settled, with no result).
    REPLACED = "replaced"
    #: ``Reject(requeue=True)``: ready at once; Celery re-delivers the message.
    REQUEUED = "requeued"
    #: ``Reject(requeue=False)``: dead, settled at once (Celery stores nothing), never re-run.
    REJECTED = "rejected"
    #: ``Ignore``: done with no result, settled at once (Celery stores nothing), never re-run.
    IGNORED = "ignored"
    #: ``SystemExit``/``KeyboardInterrupt`` (shutdown, revoke with terminate): released so
    #: the requeued message is claimed at once; the exit goes on.
    TERMINATED = "terminated"
    #: The lease was lost under the body: never the task's failure; released (if the store
    #: still held it) and run again.
    LOST = "lost"
    #: The task fails: dead with the error; Celery stores the failure and calls errbacks.
    FAIL = "fail"
    #: ``lease_retry_errors``: released with a backoff and retried.
    BACKOFF = "backoff"


@dataclass(frozen=True)
class Outcome:
    end: End
    #: Recorded on the row and in the logs.
    reason: str
    #: RETRY: seconds until the retry is due; BACKOFF: the backoff before the next attempt.
    delay: float = 0.0


def decide(exc: BaseException, *, policy: Policy, attempts: int, cancelled: str | None = None,
           lost: bool = False, replaced: bool = False, retry_time_limits: bool = False,
           soft_limit: Any = None, autoretry_for: tuple[type[BaseException], ...] = (),
           celery_retries_exhausted: bool = False, eager: bool = False,
           now: datetime.datetime | None = None) -> Outcome:
    """The end of an attempt whose body raised ``exc``.

    ``attempts``: the row's count, this claim included; ``cancelled``: the operator's cancel
    seen by this execution; ``lost``: the lease is lost by this execution's reckoning;
    ``replaced``: the task called ``replace()`` (Celery then raises ``Ignore``);
    ``autoretry_for`` and ``celery_retries_exhausted``: Celery's retries of this error are
    spent; ``eager``: an eager call (Celery runs a retry at once); ``now``: for an ``eta``.
    """
    if cancelled is not None and isinstance(exc, Exception):
        return Outcome(End.CANCELLED, cancelled)
    if isinstance(exc, Retry):
        return Outcome(End.RETRY, f"Retry {_humanized(exc)}",
                       0.0 if eager else retry_delay(exc, now=now))
    if isinstance(exc, Reject):
        if exc.requeue:
            return Outcome(End.REQUEUED, f"Reject(requeue=True): {exc.reason!r}")
        return Outcome(End.REJECTED, f"rejected: {exc.reason!r}")
    if isinstance(exc, Ignore):
        if replaced:
            return Outcome(End.REPLACED, "replaced by a new task")
        return Outcome(End.IGNORED, "ignored: the task raised Ignore")
    if not isinstance(exc, Exception):
        return Outcome(End.TERMINATED, f"worker shutdown: the task was terminated ({exc!r})")
    if isinstance(exc, LeaseLost) or lost:
        return Outcome(End.LOST, repr(exc))
    if isinstance(exc, SoftTimeLimitExceeded):
        if not retry_time_limits:
            # One FAILURE, as Celery reports it: a time limit is not a transient error.
            return Outcome(End.FAIL, f"soft time limit exceeded ({soft_limit}s): {exc!r}")
        # lease_retry_time_limits opts this error into the lease's retries.
        policy = dataclasses.replace(policy, retry_errors=True)
    if celery_retries_exhausted:
        return Outcome(End.FAIL, f"Celery's max_retries exhausted: {exc!r}")
    if autoretry_for and isinstance(exc, autoretry_for):
        # Celery's autoretry_for already spent its own retries on this error.
        return Outcome(End.FAIL, f"failed after Celery's retries: {exc!r}")
    verdict, reason = policy.after_error(exc, attempts=attempts)
    if verdict is PolicyVerdict.DEAD:
        return Outcome(End.FAIL, reason)
    return Outcome(End.BACKOFF, reason, 0.0 if eager else policy.backoff(attempts))


def retry_delay(retry: Retry, *, now: datetime.datetime | None = None) -> float:
    """Seconds from ``now`` until Celery's retry is due (its countdown, or its eta)."""
    when = retry.when
    if isinstance(when, numbers.Real):
        return max(float(when), 0.0)
    if isinstance(when, datetime.datetime):
        now = now or datetime.datetime.now(datetime.timezone.utc)
        return max(float((maybe_make_aware(when) - now).total_seconds()), 0.0)
    return 0.0


def retry_message(retry: Retry) -> dict[str, Any] | None:
    """The retry's message as the lease row records a delivery (a signature as a dict), without
    its countdown or eta: the row's ``not_before`` holds when it is due, and a re-publish of a
    lost retry happens after that."""
    signature = retry.sig
    if not isinstance(signature, Mapping):
        return None
    info = dict(signature)
    options = {name: value for name, value in dict(info.get("options") or {}).items()
               if value is not None and name not in ("countdown", "eta")}
    info["options"] = options
    return info


def _humanized(retry: Retry) -> str:
    when = retry.when
    return f"in {when}s" if isinstance(when, numbers.Real) else f"at {when}"
