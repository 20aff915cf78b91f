"""Key-group limits: the values the stores and the worker exchange, and their checks.

A *group* is a name that several keys (of one task or of several) share: at most ``limit`` of
its keys run at once across every worker, and at most ``rate`` of them start per period. The
running count is the group's running rows whose lease has not expired, judged by the store on
its clock, in the claim that takes a slot: a slot *is* a lease, renewed by the heartbeat with
it, freed by its finish, release or death, and lost with it when its holder stalls past the
ttl. A delivery over the limit is parked as a waiter (its message acked); a slot that frees
hands the next waiters on (``Store.hand_on``): their deliveries are published again.

The rate is spaced evenly, as Celery's own ``rate_limit`` is (a token bucket of capacity 1):
with ``4/s`` two starts of a group are at least 0.25 s apart on the store's clock, so no
one-second window holds more than 4. The group's row keeps the next allowed start (GCRA's
theoretical arrival time).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from .errors import ConfigError

__all__ = [
    "GroupLimit",
    "LimitGroup",
    "LimitRefused",
    "Rate",
    "Waiter",
    "check_concurrency",
    "check_group_limit",
    "parse_rate",
]

_PERIODS = {"s": 1.0, "m": 60.0, "h": 3600.0}
_RATE = re.compile(r"^\s*(?P<count>\d+(?:\.\d+)?)\s*(?:/\s*(?P<period>[smh]))?\s*$")


@dataclass(frozen=True)
class Rate:
    """At most ``count`` starts per ``period`` seconds, spaced ``interval`` apart."""

    text: str
    count: float
    period: float

    @property
    def interval(self) -> float:
        """Seconds between two starts."""
        return self.period / self.count

    def __str__(self) -> str:
        return self.text


def parse_rate(value: object, *, name: str = "lease_rate_limit") -> Rate:
    """Celery's rate format (``"10/s"``, ``"100/m"``, ``"5/h"``; a bare number is per
    second), or ``ConfigError`` naming ``name``."""
    if isinstance(value, Rate):
        return value
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ConfigError(f"{name} must be a rate such as '10/s', '100/m' or '5/h', "
                          f"got {type(value).__name__}: {value!r}")
    match = _RATE.match(str(value))
    if match is None:
        raise ConfigError(f"{name} must be a rate such as '10/s', '100/m' or '5/h' (Celery's "
                          f"format: a number, then /s, /m or /h), got {value!r}")
    count = float(match["count"])
    if not count > 0:
        raise ConfigError(f"{name} must allow at least one start per period, got {value!r}")
    period = match["period"] or "s"
    return Rate(text=f"{match['count']}/{period}", count=count, period=_PERIODS[period])


def check_concurrency(value: object, *, name: str = "lease_limit") -> int:
    """A limit: a whole number >= 1, or ``ConfigError`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, str) and value.strip().isdigit():  # read from the environment
            value = int(value)
        else:
            raise ConfigError(f"{name} must be a whole number >= 1 (at most that many run at "
                              f"once), got {type(value).__name__}: {value!r}")
    if value < 1:
        raise ConfigError(f"{name} must be a whole number >= 1 (at most that many run at "
                          f"once), got {value!r}: to stop a group's work, cancel its keys")
    return value


@dataclass(frozen=True)
class GroupLimit:
    """What a limited claim asks of the store: the group, and the task's limit and rate
    (either may be None, not both). An operator's ``leases limit`` overrides them."""

    group: str
    limit: int | None = None
    rate: Rate | None = None

    def __post_init__(self) -> None:
        if self.limit is None and self.rate is None:
            raise ConfigError(f"limit group {self.group!r}: a limit or a rate is needed")


def check_group_limit(value: object) -> GroupLimit:
    if not isinstance(value, GroupLimit):
        raise TypeError(f"expected a GroupLimit, got {type(value).__name__}: {value!r}")
    return value


@dataclass(frozen=True)
class LimitRefused:
    """A limited claim the group refused (the key itself was claimable).

    ``parked``: the delivery waits on the store, ``waiting`` in its group (itself included),
    until a slot frees and it is handed on: its message may be acked. Not parked (``rate``,
    or a delivery whose task info could not be recorded): run again at ``retry_at`` (store
    clock)."""

    group: str
    reason: str  # "limit" | "rate"
    parked: bool
    waiting: int = 0
    running: int = 0
    limit: int | None = None
    retry_at: float | None = None


@dataclass(frozen=True)
class Waiter:
    """A parked delivery handed on: its recorded task info, to publish again."""

    group: str
    key: str
    task: dict[str, Any] | None
    since: float


@dataclass(frozen=True)
class LimitGroup:
    """A group as ``leases limits`` lists it: the limit and rate in force (an operator's if
    set, else the task's), the task's own, and how many run and wait now."""

    group: str
    limit: int | None
    rate: str | None
    running: int
    waiting: int
    task_limit: int | None = None
    task_rate: str | None = None
    #: Set by an operator (``leases limit``): the limit/rate override the task's.
    limit_set: bool = False
    rate_set: bool = False
    updated_at: float | None = None

    @property
    def overridden(self) -> tuple[str, ...]:
        """What an operator set: ``("limit",)``, ``("rate",)``, both, or nothing."""
        return tuple(what for what, flag in (("limit", self.limit_set),
                                             ("rate", self.rate_set)) if flag)
