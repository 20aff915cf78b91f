"""Every ``lease_*`` name lease_celery reads, where each may be set (both derived from the
settings table, ``lease_celery.catalog``), and the check that finds names it does not read
(a misspelling, or an app-wide setting put on a task).

Celery passes unknown settings and task options through without a word, so a misspelled
``lease_keys`` silently keys a task on its id (deduplication off) and ``lease_tll`` leaves the
default ttl in force. ``doctor`` reports these findings and the worker logs them at start.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any

from .apps import MARKER, is_leased
from .catalog import SETTINGS

__all__ = ["APP_ONLY", "FIXES", "TASK_ONLY", "TASK_OR_APP", "NameProblem", "name_problems"]

#: Settings a task attribute overrides (``lease_celery.settings``).
TASK_OR_APP = frozenset(s.name for s in SETTINGS if s.scope == "both")
#: Options only a task has: they describe one task's messages (``permanent_errors``, not a
#: ``lease_*`` name, is not checked here).
TASK_ONLY = frozenset(s.name for s in SETTINGS
                      if s.scope == "task" and s.name.startswith("lease_"))
#: Settings of the workers (sweeper, retention, metrics): read from the app's configuration
#: only, so on a task they do nothing.
APP_ONLY = frozenset(s.name for s in SETTINGS if s.scope == "app")

#: What each name takes: the fix a finding suggests.
FIXES: dict[str, str] = {s.name: s.fix for s in SETTINGS}

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
