"""The lease's own failure policy: what it adds to Celery's, and nothing else.

An exception fails the task at once, as in Celery, unless the task asks for retries: Celery's
own (``self.retry``, ``autoretry_for``, ``max_retries``), or the lease's error retries
(``lease_retry_errors = True``): released with a backoff and run again until
``lease_max_attempts``, counted on the lease row, so the count survives redelivery, a lost
message and a new worker (Celery's ``request.retries`` lives in the message and does not).
Whatever the task asks for, a key whose worker is lost more than ``lease_max_takeovers``
times goes ``dead``: a task that kills its worker on every try must not loop forever.
"""

from __future__ import annotations

import enum
import random
from dataclasses import dataclass

from celery.exceptions import MaxRetriesExceededError

from .errors import (
    ConfigError,
    EffectConflict,
    EffectOutcomeUnknown,
    InvalidKey,
    PayloadNotSerializable,
    ResultNotSerializable,
)

__all__ = ["DEFAULT_PERMANENT_ERRORS", "Outcome", "Policy"]

#: Errors no retry can fix: the same input fails the same way, or a person must decide first
#: (an effect whose outcome is unknown waits for reconciliation, then a requeue).
DEFAULT_PERMANENT_ERRORS: tuple[type[BaseException], ...] = (
    ResultNotSerializable, PayloadNotSerializable, InvalidKey, MaxRetriesExceededError,
    EffectConflict, EffectOutcomeUnknown)


class Outcome(enum.Enum):
    RETRY = "retry"  # release with a backoff and run again
    DEAD = "dead"    # give up: the key goes dead with the reason


@dataclass(frozen=True)
class Policy:
    max_attempts: int
    max_takeovers: int
    backoff_base: float
    backoff_max: float
    permanent_errors: tuple[type[BaseException], ...] = DEFAULT_PERMANENT_ERRORS
    #: Retry a body's exception with a backoff up to ``max_attempts`` (opt-in: Celery fails
    #: the task at once).
    retry_errors: bool = False

    def __post_init__(self) -> None:
        for name in ("max_attempts", "max_takeovers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"lease_{name} must be a whole number >= 1, got {value!r}")
        if self.backoff_max < self.backoff_base:
            raise ConfigError(f"lease_backoff_max ({self.backoff_max:g}s) is below "
                              f"lease_backoff_base ({self.backoff_base:g}s)")
        if not all(isinstance(e, type) and issubclass(e, BaseException)
                   for e in self.permanent_errors):
            raise ConfigError(f"permanent_errors must be exception classes, "
                              f"got {self.permanent_errors!r}")

    def backoff(self, attempt: int) -> float:
        """Seconds to wait after failed attempt number ``attempt`` (1-based).

        Exponential with a cap, and "equal jitter" (half fixed, half random): the delays grow
        visibly, yet many keys failing together do not come back in the same instant.
        """
        ceiling = min(self.backoff_max, self.backoff_base * 2 ** max(0, attempt - 1))
        return random.uniform(ceiling / 2, ceiling)

    def after_error(self, exc: BaseException, *, attempts: int) -> tuple[Outcome, str]:
        """Decide what a failed attempt leads to, and why (recorded on the row)."""
        if not self.retry_errors:
            return Outcome.DEAD, f"failed: {exc!r}"
        if isinstance(exc, self.permanent_errors):
            return Outcome.DEAD, f"permanent error: {exc!r}"
        if attempts >= self.max_attempts:
            return Outcome.DEAD, f"{attempts} attempts exhausted; last error: {exc!r}"
        return Outcome.RETRY, f"attempt {attempts} failed: {exc!r}"

    def on_claim(self, *, attempts: int, takeovers: int) -> str | None:
        """Why a claim must not run (the key goes dead), or None to run it."""
        if takeovers > self.max_takeovers:
            return (f"the worker running it was lost {takeovers} times "
                    f"(lease_max_takeovers={self.max_takeovers})")
        if self.retry_errors and attempts > self.max_attempts:
            return f"{attempts - 1} attempts exhausted (lease_max_attempts={self.max_attempts})"
        return None
