"""Every ``lease_*`` name lease_celery reads, where each may be set, and the check that finds
names it does not read (a misspelling, or an app-wide setting put on a task).

Celery passes unknown settings and task options through without a word, so a misspelled
``lease_keys`` silently keys a task on its id (deduplication off) and ``lease_tll`` leaves the
default ttl in force. ``doctor`` reports these findings and the worker logs them at start.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any

from .apps import MARKER, is_leased

__all__ = ["APP_ONLY", "FIXES", "TASK_ONLY", "TASK_OR_APP", "NameProblem", "name_problems"]

#: Settings a task attribute overrides (``lease_celery.settings``).
TASK_OR_APP = frozenset({
    "lease_store_url", "lease_ttl", "lease_heartbeat_interval", "lease_max_attempts",
    "lease_max_takeovers", "lease_backoff_base", "lease_backoff_max", "lease_retry_errors",
    "lease_retry_time_limits", "lease_finish_in_background", "lease_record_at_publish",
    "lease_extend_visibility", "lease_limit", "lease_rate_limit", "lease_limit_key"})
#: Options only a task has: they describe one task's messages.
TASK_ONLY = frozenset({"lease_key", "lease_unique"})
#: Settings of the workers (sweeper, retention, metrics): read from the app's configuration
#: only, so on a task they do nothing.
APP_ONLY = frozenset({"lease_sweep_interval", "lease_sweep_grace", "lease_retention",
                      "lease_metrics_port", "lease_metrics_addr", "lease_recovery_priority"})

#: What each name takes: the fix a finding suggests.
FIXES: dict[str, str] = {
    "lease_store_url": "a store URL: sqlite:////absolute/path.sqlite3, postgresql://… or "
                       "redis://…",
    "lease_ttl": "a number of seconds > 0 (30, not '30s')",
    "lease_heartbeat_interval": "a number of seconds > 0, well below lease_ttl (ttl/3, the "
                                "default when unset)",
    "lease_max_attempts": "a whole number >= 1",
    "lease_max_takeovers": "a whole number >= 1",
    "lease_backoff_base": "a number of seconds > 0",
    "lease_backoff_max": "a number of seconds > 0, not below lease_backoff_base",
    "lease_retry_time_limits": "True or False",
    "lease_retry_errors": "True or False",
    "lease_finish_in_background": "True, False or 'auto'",
    "lease_record_at_publish": "True or False",
    "lease_extend_visibility": "True or False",
    "lease_limit": "a whole number >= 1: at most that many of the group run at once",
    "lease_rate_limit": "a rate such as '10/s', '100/m' or '5/h' (Celery's format)",
    "lease_limit_key": "a format string whose fields are parameters of the task "
                       "('tenant:{tenant_id}'), a callable taking the task's arguments, or "
                       "None (the task's name)",
    "lease_key": "a format string whose fields are parameters of the task "
                 "('report:{report_id}'), a callable taking the task's arguments, or None",
    "lease_unique": "True or False",
    "lease_sweep_interval": "a number of seconds (0 turns the workers' sweeper off)",
    "lease_sweep_grace": "a number of seconds > 0",
    "lease_retention": "a number of seconds >= 0 (7 days is 604800; 0 keeps rows forever)",
    "lease_metrics_port": "a port number",
    "lease_recovery_priority": "'auto', a message priority from 0 to 255, or False",
    "lease_metrics_addr": "an address to listen on",
}

_SETTINGS = TASK_OR_APP | APP_ONLY
_TASK_OPTIONS = TASK_OR_APP | TASK_ONLY


@dataclass(frozen=True)
class NameProblem:
    """A ``lease_*`` name lease_celery does not read where it was set."""

    code: str  # settings.unknown | settings.app_only
    message: str


def name_problems(app: Any, tasks: list[Any]) -> list[NameProblem]:
    """Every ``lease_*`` name in ``app.conf`` and on ``tasks`` (LeasedTask instances) that
    lease_celery never reads, with a suggestion; never raises."""
    return _settings_problems(app) + [p for task in tasks for p in _task_problems(task)]


def _settings_problems(app: Any) -> list[NameProblem]:
    conf = app.conf
    prefix = str(getattr(conf, "prefix", None) or "")  # "CELERY_" under a namespace
    try:
        keys = sorted(conf.without_defaults().keys())
    except Exception:  # a configuration that cannot even be listed has nothing to say here
        return []
    problems: list[NameProblem] = []
    for key in keys:
        if not isinstance(key, str):
            continue
        inside = bool(prefix) and key.upper().startswith(prefix) and key.isupper()
        name = (key[len(prefix):] if inside else key).lower()
        if not name.startswith("lease_"):
            continue

        def spelled(wanted: str, *, inside: bool = inside) -> str:
            return prefix + wanted.upper() if inside else wanted

        if name not in _SETTINGS and name not in TASK_ONLY:
            problems.append(NameProblem("settings.unknown", (
                f"app.conf sets {key}, which lease_celery does not read"
                + _suggest(name, _SETTINGS, spelled) + "; it does nothing")))
        elif name in TASK_ONLY:
            problems.append(NameProblem("settings.unknown", (
                f"app.conf sets {key}, an option of a task, not a setting: pass "
                f"{name}=… to @app.task(base=LeasedTask, …); it does nothing here")))
        elif key != name and not (prefix and key == prefix + name.upper()):  # LEASE_TTL
            where = (f"{prefix}{name.upper()} (the app's namespace is "
                     f"{prefix.rstrip('_')})" if prefix else name)
            problems.append(NameProblem("settings.unknown", (
                f"app.conf sets {key}, which lease_celery does not read: did you mean "
                f"{where}? It does nothing as spelled")))
    return problems


def _task_problems(task: Any) -> list[NameProblem]:
    problems: list[NameProblem] = []
    name = getattr(task, "name", None) or type(task).__name__
    seen: set[str] = set()
    for klass in type(task).__mro__:
        if MARKER in vars(klass) or not is_leased(klass):
            break  # LeasedTask's own members (lease_settings, lease_store …) are the library's
        for attr in vars(klass):
            if not attr.startswith("lease_") or attr in seen or attr in _TASK_OPTIONS:
                continue
            seen.add(attr)
            if attr in APP_ONLY:
                problems.append(NameProblem("settings.app_only", (
                    f"task {name} sets {attr}, which is read from the app's configuration "
                    f"only: set app.conf.{attr} instead; on the task it does nothing")))
            else:
                problems.append(NameProblem("settings.unknown", (
                    f"task {name} sets {attr}, which lease_celery does not read"
                    + _suggest(attr, _TASK_OPTIONS | APP_ONLY, str) + "; it does nothing"
                    + (" (the lease is keyed on the task id)"
                       if _closest(attr, _TASK_OPTIONS) == "lease_key" else ""))))
    return problems


def _closest(name: str, known: frozenset[str]) -> str | None:
    matches = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.6)
    return matches[0] if matches else None


def _suggest(name: str, known: frozenset[str], spelled: Any) -> str:
    match = _closest(name, known)
    return f": did you mean {spelled(match)}?" if match else ""
