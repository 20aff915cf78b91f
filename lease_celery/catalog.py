"""The table of every name lease_celery reads: settings of the app, options of a task, both.

One row per name holds where it may be set (``scope``), its type (``kind``: what it takes and
the one parser of that type), its default, whether its value may come as text (a setting an
environment variable fills), the fix a refusal or a misspelling suggests, and its meaning.
Everything else is derived from the rows: LeasedTask's option attributes and definition-time
checks (``lease_celery.task``), ``resolve_settings`` and the app-wide readers
(``lease_celery.settings``), doctor's sets of names (``lease_celery.names``) and the settings
reference page (``docs/hooks.py``). Adding a setting touches a row and its use, nothing else.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from .checks import check_ttl
from .errors import ConfigError, LeaseError
from .limits import check_concurrency, parse_rate
from .stores.base import DEFAULT_SWEEP_GRACE
from .stores.registry import store_class

__all__ = [
    "BACKGROUND_AFTER",
    "DEFAULT_RETENTION",
    "DEFAULT_STORE_URL",
    "DEFAULT_TTL",
    "MAX_PRIORITY",
    "POLICY_DEFAULTS",
    "SCOPES",
    "SETTINGS",
    "Kind",
    "Scope",
    "Setting",
    "by_name",
    "read",
    "task_attributes",
]

#: A SQLite file in the worker's working directory: shared by the worker processes of one host.
DEFAULT_STORE_URL = "sqlite:///lease_celery.sqlite3"
DEFAULT_TTL = 30.0
#: Default of ``lease_retention``: settled done/dead rows older than this are pruned.
DEFAULT_RETENTION = 7 * 24 * 3600.0
#: ``lease_finish_in_background = "auto"``: bodies that ran at least this long (seconds) finish
#: behind their return on a sender thread, off the next task's path. A shorter body's finish
#: is carried by the next claim instead: for such a body the hand-off to a thread costs more
#: than the round trip it hides, and the carried finish saves the round trip.
BACKGROUND_AFTER = 0.002
#: The highest message priority any broker takes (RabbitMQ's x-max-priority bound).
MAX_PRIORITY = 255

#: Where a name may be set: on a task only, in the app's configuration only, or both (a task
#: attribute then overrides the app's setting, which overrides the default).
Scope = Literal["task", "app", "both"]
#: The scopes as the settings page says them.
SCOPES: dict[str, str] = {"both": "app, or per task", "task": "task option only",
                          "app": "app-wide only"}


@dataclass(frozen=True)
class Kind:
    """A type of setting and its one parser.

    ``check(value, label, fix)`` returns the value as lease_celery uses it or raises
    ``ConfigError`` naming ``label`` (the name and where it was set); ``from_text(text)``
    reads the text form a setting filled from the environment has (None: the type has no
    text form, and text is refused by ``check`` like any other wrong type)."""

    name: str
    check: Callable[[Any, str, str], Any]
    from_text: Callable[[str], Any] | None = None


def _refuse(label: str, fix: str, value: Any) -> ConfigError:
    return ConfigError(f"{label} must be {fix}, got {value!r}")


def _seconds(value: Any, label: str, fix: str) -> float:
    return check_ttl(value, name=label)


def _seconds_or_off(value: Any, label: str, fix: str) -> float:
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or not math.isfinite(value) or not value >= 0):
        raise _refuse(label, fix, value)
    return float(value)


def _whole(value: Any, label: str, fix: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _refuse(label, fix, value)
    return value


def _flag(value: Any, label: str, fix: str) -> bool:
    if not isinstance(value, bool):
        raise _refuse(label, fix, value)
    return value


def _flag_or_auto(value: Any, label: str, fix: str) -> bool | str:
    if not (isinstance(value, bool) or value == "auto"):
        raise _refuse(label, fix, value)
    return value  # type: ignore[no-any-return]


def _limit(value: Any, label: str, fix: str) -> int:
    return check_concurrency(value, name=label)


def _rate(value: Any, label: str, fix: str) -> Any:
    return parse_rate(value, name=label)


def _key_spec(value: Any, label: str, fix: str) -> Any:
    # The fields of a format string are checked against the task's parameters where the
    # task is known (LeasedTask.__init_subclass__, keys.check_key_spec).
    if not (isinstance(value, str) or callable(value)):
        raise ConfigError(f"{label} must be a format string, a callable or None, got "
                          f"{type(value).__name__}")
    return value


def _store_url(value: Any, label: str, fix: str) -> str:
    # Syntax only: a host that only publishes tasks need not reach the store (or have its
    # directory); workers check the rest when they start (lease_celery.worker.lifecycle).
    if not isinstance(value, str):
        raise ConfigError(f"{label} must be a URL string, got {value!r}")
    try:
        klass = store_class(value)
    except ImportError:
        # The URL names a known store whose driver (an extra) is not installed here. That is
        # no fault of the setting, and a host that only publishes needs no driver: the places
        # that open the store (a worker at start, the CLI, doctor, a publish that writes a
        # row) each say in one line which extra to install.
        return value
    except (LeaseError, ValueError) as exc:
        raise ConfigError(f"{label} is not usable: {exc}") from exc
    try:
        klass.check_url(value)
    except (LeaseError, ValueError) as exc:
        raise ConfigError(f"{label} is not usable: {exc}") from exc
    return value


def _port(value: Any, label: str, fix: str) -> int | None:
    if value == 0 and not isinstance(value, bool):
        return None
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or value != int(value) or not 0 < value < 65536):
        raise ConfigError(f"{label} must be a port number (1-65535), got {value!r}")
    return int(value)


def _address(value: Any, label: str, fix: str) -> str:
    if not isinstance(value, str) or not value:
        raise _refuse(label, fix, value)
    return value


def _priority(value: Any, label: str, fix: str) -> int | None:
    if value == "auto":
        return value  # type: ignore[no-any-return]
    if value is False:
        return None  # re-published work keeps the priority it was published with
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_PRIORITY:
        raise ConfigError(f"{label} must be 'auto', a priority from 0 to {MAX_PRIORITY} or "
                          f"False, got {value!r}")
    return value


def _exception_classes(value: Any, label: str, fix: str) -> tuple[type[BaseException], ...]:
    found = (value,) if isinstance(value, type) else tuple(value or ())
    if not all(isinstance(e, type) and issubclass(e, BaseException) for e in found):
        raise ConfigError(f"permanent_errors must be exception classes, got {value!r}")
    return found


def _number_text(text: str) -> Any:
    """A number's text (``"30"``, ``"0.5"``) as the number; other text as it is, for the
    type's check to refuse by its own words."""
    try:
        number = float(text)
    except ValueError:
        return text
    return int(number) if number.is_integer() and "." not in text else number


def _priority_text(text: str) -> Any:
    return int(text) if text.strip().isdigit() else text


SECONDS = Kind("seconds", _seconds, _number_text)
SECONDS_OR_OFF = Kind("seconds_or_off", _seconds_or_off, _number_text)
WHOLE = Kind("whole", _whole, _number_text)
FLAG = Kind("flag", _flag)
FLAG_OR_AUTO = Kind("flag_or_auto", _flag_or_auto)
#: A concurrency limit (how many of a group run at once); its text form is the CLI's too.
LIMIT = Kind("limit", _limit, _number_text)
RATE = Kind("rate", _rate)
KEY_SPEC = Kind("key_spec", _key_spec)
STORE_URL = Kind("store_url", _store_url)
PORT = Kind("port", _port, _number_text)
ADDRESS = Kind("address", _address)
PRIORITY = Kind("priority", _priority, _priority_text)
EXCEPTION_CLASSES = Kind("exception_classes", _exception_classes)


@dataclass(frozen=True)
class Setting:
    """One row of the table.

    ``default``: the value when nothing sets it (None: off, or a rule ``shown_default``
    states). ``text``: a value given as text (a setting filled from an environment variable)
    is read by the kind's text form; elsewhere text is refused, so ``lease_ttl = "30s"`` in
    code fails loudly. ``fix``: what the name takes, said by refusals and by doctor.
    ``shown_default``: the default as the settings page shows it (``{default}`` is the
    default rendered); ``meaning``: the page's description."""

    name: str
    scope: Scope
    kind: Kind
    default: Any
    fix: str
    meaning: str
    shown_default: str = "{default}"
    text: bool = False

    def parse(self, value: Any, label: str) -> Any:
        """``value`` checked by the row's kind (its text form first where the row takes
        text), or ``ConfigError`` naming ``label``."""
        if self.text and isinstance(value, str) and self.kind.from_text is not None:
            value = self.kind.from_text(value)
        return self.kind.check(value, label, self.fix)

    @property
    def on_task(self) -> bool:
        """A task may set it (as an attribute or ``@app.task`` option)."""
        return self.scope in ("task", "both")

    @property
    def in_conf(self) -> bool:
        """The app's configuration may set it."""
        return self.scope in ("app", "both")

    def rendered_default(self) -> str:
        """The default as the settings page shows it."""
        value = self.default
        if isinstance(value, bool) or value is None or isinstance(value, tuple):
            shown = f"`{value!r}`" if value is not None else "off"
        elif isinstance(value, (int, float)):
            shown = f"`{value:g}`" if value < 1e5 else f"`{value:.0f}`"
        else:
            shown = f"`\"{value}\"`" if self.kind is not STORE_URL else f"`{value}`"
        return self.shown_default.format(default=shown)


_BOOL = "True or False"
_KEY = ("a format string whose fields are parameters of the task ('{example}'), a callable "
        "taking the task's arguments, or None")

SETTINGS: tuple[Setting, ...] = (
    Setting("lease_store_url", "both", STORE_URL, DEFAULT_STORE_URL,
            "a store URL: sqlite:////absolute/path.sqlite3, postgresql://… or redis://…",
            "`sqlite:////absolute/path.sqlite3`, `sqlite:///relative` (to each process's "
            "working directory: `doctor` warns), `sqlite://` (in memory, one process), "
            "`postgresql://…`, `redis://…` ([Stores](../stores.md))",
            shown_default="{default} (in the working directory)"),
    Setting("lease_ttl", "both", SECONDS, DEFAULT_TTL,
            "a number of seconds > 0 (30, not '30s')",
            "seconds a claim or renewal holds the lease"),
    Setting("lease_heartbeat_interval", "both", SECONDS, None,
            "a number of seconds > 0, well below lease_ttl (ttl/3, the default when unset)",
            "seconds between renewals; must be below `lease_ttl`",
            shown_default="`lease_ttl / 3`"),
    Setting("lease_key", "task", KEY_SPEC, None, _KEY.format(example="report:{report_id}"),
            "`\"report:{report_id}\"` (a format string over the task's arguments), or a "
            "callable taking the task's arguments", shown_default="the task id"),
    Setting("lease_unique", "task", FLAG, False, _BOOL,
            "`True`: `apply_async` returns the `AsyncResult` of the delivery that holds, waits "
            "to retry or finished the key, and publishes nothing (also per call: "
            "`apply_async(..., lease_unique=True)`; [Unique at enqueue](../brokers.md#unique))"),
    Setting("lease_retry_errors", "both", FLAG, False, _BOOL,
            "`True`: a body's exception is retried by the lease with a backoff, up to "
            "`lease_max_attempts`; by default it fails the task at once, as in Celery "
            "(Celery's own `self.retry`, `autoretry_for` and `max_retries` work either way)"),
    Setting("lease_max_attempts", "both", WHOLE, 3, "a whole number >= 1",
            "with `lease_retry_errors`: claims of one key that may fail (takeovers included) "
            "before it goes `dead`; a Celery retry or a `replace()` gives its attempt back"),
    Setting("lease_max_takeovers", "both", WHOLE, 3, "a whole number >= 1",
            "times the worker running it may be lost (SIGKILL, OOM) before it goes `dead`"),
    Setting("lease_backoff_base", "both", SECONDS, 1.0, "a number of seconds > 0",
            "seconds: backoff after attempt n is `min(max, base·2ⁿ⁻¹)`, with equal jitter"),
    Setting("lease_backoff_max", "both", SECONDS, 60.0,
            "a number of seconds > 0, not below lease_backoff_base",
            "seconds: the longest backoff (see `lease_backoff_base`)"),
    Setting("permanent_errors", "task", EXCEPTION_CLASSES, (), "a tuple of exception classes",
            "with `lease_retry_errors`: exception classes that go `dead` at once (added to "
            "the built-in ones: non-JSON result or payload, bad key, effect conflict or "
            "unknown outcome, `MaxRetriesExceededError`)"),
    Setting("lease_sweep_interval", "app", SECONDS_OR_OFF, None,
            "a number of seconds >= 0 (0 turns the workers' sweeper off)",
            "seconds between the workers' sweeps; `0` turns it off "
            "([The sweeper](../operations.md#the-sweeper))",
            shown_default="half the smallest `lease_ttl`", text=True),
    Setting("lease_sweep_grace", "app", SECONDS, DEFAULT_SWEEP_GRACE, "a number of seconds > 0",
            "seconds: a ready row unclaimed this long after it became claimable is "
            "re-published, and no row is re-published twice within it", text=True),
    Setting("lease_extend_visibility", "both", FLAG, False, _BOOL,
            "`True`: on SQS and Redis brokers the worker keeps a running task's message from "
            "being handed out again while its lease is renewed "
            "([Extending the visibility](../brokers.md#extend-visibility))"),
    Setting("lease_record_at_publish", "both", FLAG, False, _BOOL,
            "`True`: `apply_async` writes the key's row (`ready`, with the message) before "
            "publishing, so a message the broker loses is re-published by the sweeper (also "
            "per call: `apply_async(..., lease_record=True)`; "
            "[A row from the moment of publish](../brokers.md#record-at-publish))"),
    Setting("lease_limit", "both", LIMIT, None,
            "a whole number >= 1: at most that many of the group run at once",
            "at most this many executions of the task's group run at once, across every "
            "worker; the rest wait on the store, their messages acked "
            "([Key-group limits](../limits.md))", text=True),
    Setting("lease_rate_limit", "both", RATE, None,
            "a rate such as '10/s', '100/m' or '5/h' (Celery's format)",
            "at most this many starts of the group per period, across every worker: Celery's "
            "format, `\"10/s\"`, `\"100/m\"`, `\"5/h\"`"),
    Setting("lease_limit_key", "both", KEY_SPEC, None,
            _KEY.format(example="tenant:{tenant_id}") + " (the task's name)",
            "the group, given like `lease_key`: `\"tenant:{tenant_id}\"` or a callable; tasks "
            "of different names may share one", shown_default="the task's name"),
    Setting("lease_recovery_priority", "app", PRIORITY, "auto",
            "'auto', a message priority from 0 to 255, or False",
            "the message priority of recovered work (re-published by the sweeper, the "
            "time-limit handler, or a delivery whose lease lapsed or whose store did not "
            "answer): `\"auto\"` takes the broker's first (Redis: `0`; RabbitMQ: the queue's "
            "`x-max-priority`), a number is used as it is, `False` keeps the priority the work "
            "was published with ([Recovered work](../brokers.md#recovery-priority))",
            text=True),
    Setting("lease_retention", "app", SECONDS_OR_OFF, DEFAULT_RETENTION,
            "a number of seconds >= 0 (7 days is 604800; 0 keeps rows forever)",
            "seconds a settled `done`/`dead` row is kept; the sweeper prunes older ones, oldest "
            "first, 100 per sweep in one short write; `0` keeps them forever. Tokens never "
            "restart", shown_default="{default} (7 days)", text=True),
    Setting("lease_retry_time_limits", "both", FLAG, False, _BOOL,
            "`True`: Celery's soft and hard time limits are retried by the policy instead of "
            "ending the key `dead` ([Time limits](../long-work.md#time-limits))"),
    Setting("lease_finish_in_background", "both", FLAG_OR_AUTO, "auto", "True, False or 'auto'",
            "a task whose outcome Celery neither stores nor sends on returns without waiting "
            "for its finish, which a heartbeat thread writes: `True` always, `False` never, "
            f"`\"auto\"` when the body ran at least {BACKGROUND_AFTER * 1000:g} ms "
            "([Fire-and-forget tasks](../guarantees.md#fire-and-forget-tasks))"),
    Setting("lease_metrics_port", "app", PORT, None, "a port number",
            "the port the worker's main process serves Prometheus metrics on "
            "([Metrics](../observability.md#metrics))", text=True),
    Setting("lease_metrics_addr", "app", ADDRESS, "127.0.0.1", "an address to listen on",
            "the address the metrics are served on", text=True),
)

_BY_NAME: dict[str, Setting] = {setting.name: setting for setting in SETTINGS}

#: Defaults of the failure policy settings (``lease_<name>``).
POLICY_DEFAULTS: dict[str, float] = {
    name: _BY_NAME[f"lease_{name}"].default
    for name in ("max_attempts", "max_takeovers", "backoff_base", "backoff_max")}


def by_name(name: str) -> Setting:
    """The row of ``name`` (``KeyError`` for a name lease_celery does not read)."""
    return _BY_NAME[name]


def task_attributes() -> dict[str, Any]:
    """LeasedTask's option attributes: each name a task may set, as its class attribute.
    An option that only a task has starts at its default; one the app may set too starts at
    None (unset: the app's setting, else the default, applies)."""
    return {setting.name: (setting.default if setting.scope == "task" else None)
            for setting in SETTINGS if setting.on_task and setting.name.startswith("lease_")}


def lookup(app: Any, task: Any, name: str) -> tuple[Any, str]:
    """``(value, source)`` of ``name`` as set (None when unset everywhere): on ``task`` if
    the row lets a task set it, else in ``app.conf`` if the row lets the app set it."""
    setting = _BY_NAME[name]
    if task is not None and setting.on_task:
        value = getattr(task, name, None)
        if value is not None:
            return value, f"task attribute {getattr(task, 'name', None) or task!s}.{name}"
    conf = getattr(app, "conf", None) if setting.in_conf else None
    value = conf.get(name) if conf is not None else None
    if value is not None:
        return value, f"setting {name}"
    return None, "default"


def read(app: Any, task: Any, name: str) -> tuple[Any, str]:
    """``(value, source)`` of ``name`` for ``task`` (or app-wide when None): the value set,
    checked by the row's kind, or the row's default."""
    value, source = lookup(app, task, name)
    if value is None:
        return _BY_NAME[name].default, source
    return _BY_NAME[name].parse(value, f"{name} ({source})"), source
