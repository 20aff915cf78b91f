"""The ``lease_*`` settings: defaults, validation, and per-task override resolution.

Order of precedence: a task attribute (``lease_ttl = 60`` on the task) beats the Celery setting
(``app.conf.lease_ttl``, so ``CELERY_LEASE_TTL`` works under a namespace), which beats the
default. Every refusal names the setting and where its value came from.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

from .checks import check_ttl
from .errors import ConfigError, LeaseError
from .limits import Rate, check_limit_value, parse_rate
from .policy import DEFAULT_PERMANENT_ERRORS, Policy
from .stores.base import DEFAULT_SWEEP_GRACE
from .stores.registry import store_class

__all__ = ["DEFAULT_RETENTION", "DEFAULT_STORE_URL", "DEFAULT_TTL", "MAX_PRIORITY",
           "LeaseSettings", "metrics_port", "recovery_priority_setting", "resolve_settings",
           "retention", "store_url_of", "sweep_grace", "sweep_interval"]

#: A SQLite file in the worker's working directory: shared by the worker processes of one host.
DEFAULT_STORE_URL = "sqlite:///lease_celery.sqlite3"
DEFAULT_TTL = 30.0
#: ``lease_finish_in_background = "auto"``: bodies that ran at least this long (seconds) finish
#: behind their return on a sender thread, off the next task's path. A shorter body's finish
#: is carried by the next claim instead: for such a body the hand-off to a thread costs more
#: than the round trip it hides, and the carried finish saves the round trip.
BACKGROUND_AFTER = 0.002
#: Where a finish nothing waits for is written (``LeaseSettings.finish_mode``).
FinishMode = Literal["inline", "background", "carried"]


#: Defaults of the failure policy settings (``lease_<name>``).
POLICY_DEFAULTS: dict[str, float] = {
    "max_attempts": 3, "max_takeovers": 3, "backoff_base": 1.0, "backoff_max": 60.0}


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


def _lookup(app: Any, task: Any, name: str) -> tuple[Any, str]:
    """Return ``(value, source)`` for setting ``name``; value is None when unset everywhere."""
    value = getattr(task, name, None) if task is not None else None
    if value is not None:
        return value, f"task attribute {getattr(task, 'name', None) or task!s}.{name}"
    value = app.conf.get(name) if app is not None else None
    if value is not None:
        return value, f"setting {name}"
    return None, "default"


def resolve_settings(app: Any, task: Any = None) -> LeaseSettings:
    """Resolve and validate the lease settings for ``task`` (or app-wide when ``task`` is None)."""
    ttl_value, ttl_source = _lookup(app, task, "lease_ttl")
    ttl = check_ttl(DEFAULT_TTL if ttl_value is None else ttl_value,
                    name=f"lease_ttl ({ttl_source})")

    interval_value, interval_source = _lookup(app, task, "lease_heartbeat_interval")
    if interval_value is None:
        interval = ttl / 3
    else:
        interval = check_ttl(interval_value,
                             name=f"lease_heartbeat_interval ({interval_source})")
        if interval >= ttl:
            raise ConfigError(
                f"lease_heartbeat_interval ({interval_source}) is {interval:g}s, not shorter than"
                f" lease_ttl {ttl:g}s: the lease would expire before its first renewal"
            )

    url = store_url_of(app, task)
    retry_value, retry_source = _lookup(app, task, "lease_retry_time_limits")
    if retry_value is not None and not isinstance(retry_value, bool):
        raise ConfigError(f"lease_retry_time_limits ({retry_source}) must be True or False, "
                          f"got {retry_value!r}")
    background_value, background_source = _lookup(app, task, "lease_finish_in_background")
    if background_value is not None and not (isinstance(background_value, bool)
                                             or background_value == "auto"):
        raise ConfigError(f"lease_finish_in_background ({background_source}) must be True, "
                          f"False or 'auto', got {background_value!r}")
    record_value, record_source = _lookup(app, task, "lease_record_at_publish")
    if record_value is not None and not isinstance(record_value, bool):
        raise ConfigError(f"lease_record_at_publish ({record_source}) must be True or False, "
                          f"got {record_value!r}")
    extend_value, extend_source = _lookup(app, task, "lease_extend_visibility")
    if extend_value is not None and not isinstance(extend_value, bool):
        raise ConfigError(f"lease_extend_visibility ({extend_source}) must be True or False, "
                          f"got {extend_value!r}")
    limit_value, limit_source = _lookup(app, task, "lease_limit")
    limit = None if limit_value is None else check_limit_value(
        limit_value, name=f"lease_limit ({limit_source})")
    rate_value, rate_source = _lookup(app, task, "lease_rate_limit")
    rate = None if rate_value is None else parse_rate(
        rate_value, name=f"lease_rate_limit ({rate_source})")
    limit_key, limit_key_source = _lookup(app, task, "lease_limit_key")
    if limit_key is not None and not (isinstance(limit_key, str) or callable(limit_key)):
        raise ConfigError(f"lease_limit_key ({limit_key_source}) must be a format string, a "
                          f"callable or None, got {type(limit_key).__name__}")
    return LeaseSettings(store_url=url, ttl=ttl, heartbeat_interval=interval,
                         limit_key=limit_key, limit=limit, rate=rate,
                         record_at_publish=bool(record_value),
                         extend_visibility=bool(extend_value),
                         policy=_resolve_policy(app, task), retry_time_limits=bool(retry_value),
                         finish_in_background=(
                             "auto" if background_value is None else background_value))


def store_url_of(app: Any, task: Any = None) -> str:
    """``lease_store_url`` for ``task`` (or app-wide), checked for syntax only: a host that
    only publishes tasks need not reach the store (or have its directory); workers check
    the rest when they start (lease_celery.worker.lifecycle)."""
    value, source = _lookup(app, task, "lease_store_url")
    url = DEFAULT_STORE_URL if value is None else value
    if not isinstance(url, str):
        raise ConfigError(f"lease_store_url ({source}) must be a URL string, got {url!r}")
    try:
        store_class(url).check_url(url)
    except (LeaseError, ValueError, ImportError) as exc:  # ImportError: the extra is missing
        raise ConfigError(f"lease_store_url ({source}) is not usable: {exc}") from exc
    return url


#: Default of ``lease_retention``: settled done/dead rows older than this are pruned.
DEFAULT_RETENTION = 7 * 24 * 3600.0


def retention(app: Any) -> float:
    """``lease_retention``: seconds a settled done/dead row is kept (0: forever)."""
    conf = getattr(app, "conf", None)
    value = conf.get("lease_retention") if conf is not None else None
    if value is None:
        return DEFAULT_RETENTION
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ConfigError(f"lease_retention (setting lease_retention) must be a number of "
                          f"seconds >= 0 (0 keeps rows forever), got {value!r}")
    return float(value)


def sweep_interval(app: Any) -> float | None:
    """``lease_sweep_interval``: seconds between the workers' sweeps (0: no sweeper), or None
    when unset (the workers then sweep every half of their shortest ttl)."""
    value = _app_setting(app, "lease_sweep_interval")
    if value is None:
        return None
    number = _number(value)
    if number is None or not number >= 0 or not math.isfinite(number):
        raise ConfigError(f"lease_sweep_interval (setting lease_sweep_interval) must be a "
                          f"number of seconds >= 0 (0 turns the sweeper off), got {value!r}")
    return number


def metrics_port(app: Any) -> int | None:
    """``lease_metrics_port``: the port the workers serve Prometheus metrics on, or None."""
    value = _app_setting(app, "lease_metrics_port")
    number = None if value is None else _number(value)
    if number == 0 or value is None:
        return None
    if number is None or number != int(number) or not 0 < number < 65536:
        raise ConfigError(f"lease_metrics_port (setting lease_metrics_port) must be a port "
                          f"number (1-65535), got {value!r}")
    return int(number)


def _number(value: Any) -> float | None:
    """``value`` as a number: an int, a float, or their text (settings read from the
    environment are text); None for anything else."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    return None


def _app_setting(app: Any, name: str) -> Any:
    conf = getattr(app, "conf", None)
    return conf.get(name) if conf is not None else None


def sweep_grace(app: Any) -> float:
    """``lease_sweep_grace``: seconds between two re-publishes of one row by the sweeper."""
    conf = getattr(app, "conf", None)
    value = conf.get("lease_sweep_grace") if conf is not None else None
    if value is None:
        return DEFAULT_SWEEP_GRACE
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(f"lease_sweep_grace (setting lease_sweep_grace) must be a number of "
                          f"seconds > 0, got {value!r}")
    return float(value)


#: The highest message priority any broker takes (RabbitMQ's x-max-priority bound).
MAX_PRIORITY = 255


def recovery_priority_setting(app: Any) -> int | str | None:
    """``lease_recovery_priority``: ``"auto"`` (the default: the broker's first priority, see
    ``lease_celery.execution.recovery``), a priority number as the broker reads it, or False
    (re-published work keeps the priority it was published with), returned as None."""
    value = _app_setting(app, "lease_recovery_priority")
    if value is None or value == "auto":
        return "auto"
    if value is False:
        return None
    if isinstance(value, str) and value.strip().isdigit():  # read from the environment
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_PRIORITY:
        raise ConfigError(f"lease_recovery_priority (setting lease_recovery_priority) must be "
                          f"'auto', a priority from 0 to {MAX_PRIORITY} or False, got {value!r}")
    return value


def _resolve_policy(app: Any, task: Any) -> Policy:
    values: dict[str, Any] = {}
    for name, default in POLICY_DEFAULTS.items():
        value, source = _lookup(app, task, f"lease_{name}")
        value = default if value is None else value
        if name.startswith("backoff"):
            value = check_ttl(value, name=f"lease_{name} ({source})")
        elif isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"lease_{name} ({source}) must be a whole number >= 1, "
                              f"got {value!r}")
        values[name] = value
    extra = getattr(task, "permanent_errors", None) or ()
    if not isinstance(extra, tuple):
        extra = (extra,) if isinstance(extra, type) else tuple(extra)
    retry_errors, retry_source = _lookup(app, task, "lease_retry_errors")
    if retry_errors is not None and not isinstance(retry_errors, bool):
        raise ConfigError(f"lease_retry_errors ({retry_source}) must be True or False, "
                          f"got {retry_errors!r}")
    return Policy(permanent_errors=DEFAULT_PERMANENT_ERRORS + extra,
                  retry_errors=bool(retry_errors), **values)
