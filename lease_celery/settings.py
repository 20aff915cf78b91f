"""The ``lease_*`` settings: defaults, validation, and per-task override resolution.

Order of precedence: a task attribute (``lease_ttl = 60`` on the task) beats the Celery setting
(``app.conf.lease_ttl``, so ``CELERY_LEASE_TTL`` works under a namespace), which beats the
default. Every refusal names the setting and where its value came from.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from .catalog import (
    BACKGROUND_AFTER,
    DEFAULT_RETENTION,
    DEFAULT_STORE_URL,
    DEFAULT_TTL,
    MAX_PRIORITY,
    POLICY_DEFAULTS,
    SETTINGS,
    read,
)
from .errors import ConfigError
from .limits import Rate
from .policy import DEFAULT_PERMANENT_ERRORS, Policy

__all__ = ["BACKGROUND_AFTER", "DEFAULT_RETENTION", "DEFAULT_STORE_URL", "DEFAULT_TTL",
           "MAX_PRIORITY", "POLICY_DEFAULTS", "LeaseSettings", "check_app_settings",
           "metrics_addr", "metrics_port",
           "recovery_priority_setting", "resolve_settings", "retention", "store_url_of",
           "sweep_grace", "sweep_interval"]

#: Where a finish nothing waits for is written (``LeaseSettings.finish_mode``).
FinishMode = Literal["inline", "background", "carried"]


@dataclass(frozen=True)
class LeaseSettings:
    store_url: str
    ttl: float
    heartbeat_interval: float
    policy: Policy = field(default_factory=lambda: Policy(3, 3, 1.0, 60.0))
    #: Retry Celery's soft and hard time limits under the policy instead of ending the key
    #: dead (one FAILURE, as Celery reports it).
    retry_time_limits: bool = False
    #: Write the finish of a task whose outcome Celery neither stores nor sends on behind the
    #: task's return, carried by the process's next claim or else on the heartbeat's sender
    #: threads (see ``lease_celery.execution.background``):
    #: True (always on a sender), False (in the task), or "auto" (the default, ``finish_mode``):
    #: on a sender when the body ran at least ``BACKGROUND_AFTER`` seconds (the round trip
    #: overlaps the next task), carried by the next claim after a shorter body where the
    #: store can (the hand-off to a thread would cost such a body more than the round trip).
    finish_in_background: bool | str = "auto"
    #: Write the key's row (``ready``, with the message) before publishing
    #: (``lease_celery.execution.published``).
    record_at_publish: bool = False
    #: While the lease is renewed, keep the task's message invisible to other consumers
    #: (SQS, kombu's Redis transport: ``lease_celery.worker.visibility``).
    extend_visibility: bool = False
    #: Key-group limits (``lease_celery.limits``): the group (``lease_limit_key``: a format
    #: string over the arguments, a callable, or None for the task's name), at most ``limit``
    #: of it running at once, at most ``rate`` starts (both None: not limited).
    limit_key: Any = None
    limit: int | None = None
    rate: Rate | None = None

    def finish_mode(self, body_seconds: float, *, store_carries: bool) -> FinishMode:
        """Where a finish nothing waits for is written, after a body that ran ``body_seconds``:
        ``"inline"`` (in the task), ``"background"`` (behind the return, on a sender thread)
        or ``"carried"`` (behind the return, in the process's next claim on the same store;
        a sender's if no claim comes soon). ``True`` is always background; ``"auto"``
        background after a body of ``BACKGROUND_AFTER`` or more, and after a shorter one
        carried where the store writes a carried finish in the claim's own transaction
        (``Store.carries_finish``), in the task elsewhere."""
        if self.finish_in_background == "auto":
            if body_seconds >= BACKGROUND_AFTER:
                return "background"
            return "carried" if store_carries else "inline"
        return "background" if self.finish_in_background is True else "inline"


def resolve_settings(app: Any, task: Any = None) -> LeaseSettings:
    """Resolve and validate the lease settings for ``task`` (or app-wide when ``task`` is None):
    each through its row of ``lease_celery.catalog``; then the rules between two settings."""
    ttl, _ = read(app, task, "lease_ttl")
    interval, interval_source = read(app, task, "lease_heartbeat_interval")
    if interval is None:
        interval = ttl / 3
    elif interval >= ttl:
        raise ConfigError(
            f"lease_heartbeat_interval ({interval_source}) is {interval:g}s, not shorter than"
            f" lease_ttl {ttl:g}s: the lease would expire before its first renewal"
        )
    values = {name: read(app, task, f"lease_{name}")[0] for name in (
        "store_url", "retry_time_limits", "finish_in_background", "record_at_publish",
        "extend_visibility", "limit", "limit_key")}
    rate, _ = read(app, task, "lease_rate_limit")
    return LeaseSettings(ttl=ttl, heartbeat_interval=interval, rate=rate,
                         policy=_resolve_policy(app, task), **values)


def store_url_of(app: Any, task: Any = None) -> str:
    """``lease_store_url`` for ``task`` (or app-wide), checked for syntax only: a host that
    only publishes tasks need not reach the store (or have its directory); workers check
    the rest when they start (lease_celery.worker.lifecycle)."""
    url: str = read(app, task, "lease_store_url")[0]
    return url


def retention(app: Any) -> float:
    """``lease_retention``: seconds a settled done/dead row is kept (0: forever)."""
    value: float = read(app, None, "lease_retention")[0]
    return value


def sweep_interval(app: Any) -> float | None:
    """``lease_sweep_interval``: seconds between the workers' sweeps (0: no sweeper), or None
    when unset (the workers then sweep every half of their shortest ttl)."""
    value: float | None = read(app, None, "lease_sweep_interval")[0]
    return value


def metrics_port(app: Any) -> int | None:
    """``lease_metrics_port``: the port the workers serve Prometheus metrics on, or None."""
    value: int | None = read(app, None, "lease_metrics_port")[0]
    return value


def metrics_addr(app: Any) -> str:
    """``lease_metrics_addr``: the address the workers serve Prometheus metrics on."""
    value: str = read(app, None, "lease_metrics_addr")[0]
    return value


def sweep_grace(app: Any) -> float:
    """``lease_sweep_grace``: seconds between two re-publishes of one row by the sweeper."""
    value: float = read(app, None, "lease_sweep_grace")[0]
    return value


def recovery_priority_setting(app: Any) -> int | str | None:
    """``lease_recovery_priority``: ``"auto"`` (the default: the broker's first priority, see
    ``lease_celery.execution.recovery``), a priority number as the broker reads it, or False
    (re-published work keeps the priority it was published with), returned as None."""
    value: int | str | None = read(app, None, "lease_recovery_priority")[0]
    return value


def check_app_settings(app: Any) -> list[ConfigError]:
    """The refusal of each app-wide setting ``app`` sets wrongly (doctor names them all)."""
    refused: list[ConfigError] = []
    for setting in SETTINGS:
        if setting.scope == "app":
            try:
                read(app, None, setting.name)
            except ConfigError as exc:
                refused.append(exc)
    return refused


def _resolve_policy(app: Any, task: Any) -> Policy:
    values = {name: read(app, task, f"lease_{name}")[0] for name in POLICY_DEFAULTS}
    retry_errors, _ = read(app, task, "lease_retry_errors")
    extra, _ = read(None, task, "permanent_errors")
    return Policy(permanent_errors=DEFAULT_PERMANENT_ERRORS + extra,
                  retry_errors=retry_errors, **values)
