"""One table of settings (``lease_celery.catalog``): the task's options, the settings' checks,
doctor's names and the settings page are derived from it, and its parsers read a value the
same way wherever it is set."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from celery import Celery

from lease_celery import LeasedTask, catalog, names, settings
from lease_celery.errors import ConfigError
from tests.support.docs import docs_hooks


class App:
    """Stands in for a Celery app: only ``conf`` is read."""

    def __init__(self, **conf: object) -> None:
        self.conf = conf


@pytest.mark.parametrize(("name", "text", "read"), [
    ("lease_retention", "3600", 3600.0),
    ("lease_sweep_grace", "30", 30.0),
    ("lease_sweep_interval", "5", 5.0),
    ("lease_metrics_port", "9100", 9100),
    ("lease_recovery_priority", "7", 7),
])
def test_app_wide_settings_take_their_text_form_alike(name: str, text: str, read: Any) -> None:
    """A worker's settings are often filled from its environment, as text: each app-wide
    setting reads the text of its type as the value (lease_retention and lease_sweep_grace
    refused it while lease_sweep_interval and lease_metrics_port took it)."""
    readers = {"lease_retention": settings.retention, "lease_sweep_grace": settings.sweep_grace,
               "lease_sweep_interval": settings.sweep_interval,
               "lease_metrics_port": settings.metrics_port,
               "lease_recovery_priority": settings.recovery_priority_setting}
    assert readers[name](App(**{name: text})) == read
    assert readers[name](App(**{name: read})) == read
    with pytest.raises(ConfigError, match=name):
        readers[name](App(**{name: "soon"}))


def test_a_type_has_one_parser() -> None:
    """Two settings of one kind refuse a bad value in the same words, each naming itself."""
    for bad in (-1, "x", True):
        with pytest.raises(ConfigError, match=r"lease_retention \(setting lease_retention\) "
                                              r"must be a number of seconds >= 0"):
            settings.retention(App(lease_retention=bad))
        with pytest.raises(ConfigError, match=r"lease_sweep_interval \(setting "
                                              r"lease_sweep_interval\) must be a number of "
                                              r"seconds >= 0"):
            settings.sweep_interval(App(lease_sweep_interval=bad))


def test_task_options_are_the_tables() -> None:
    """LeasedTask has an attribute for every row a task may set, None where the app may set
    it too (unset: the app's setting applies), the default for an option only a task has."""
    for setting in catalog.SETTINGS:
        if not setting.name.startswith("lease_"):
            continue
        if setting.on_task:
            expected = setting.default if setting.scope == "task" else None
            assert getattr(LeasedTask, setting.name) == expected, setting.name
        else:
            assert setting.name not in vars(LeasedTask), setting.name


def test_definition_time_checks_cover_every_task_option() -> None:
    """Every row a task may set is checked when the task class is made, by its kind."""
    app = Celery("table", broker="memory://", set_as_current=False)
    bad = {"lease_retry_errors": "yes", "lease_finish_in_background": "sometimes",
           "lease_max_attempts": 0, "lease_backoff_max": -1}
    for name, value in bad.items():
        with pytest.raises(ConfigError, match=f"{name} of task"):
            @app.task(base=LeasedTask, shared=False, **{name: value})
            def job() -> None: ...

            app.finalize()


def test_doctors_names_are_the_tables() -> None:
    """names.py's sets and fixes (what doctor and the worker check names against)."""
    rows = {s.name: s for s in catalog.SETTINGS}
    assert {n for n, s in rows.items() if s.scope == "both"} == names.TASK_OR_APP
    assert {n for n, s in rows.items() if s.scope == "app"} == names.APP_ONLY
    assert {n for n, s in rows.items()
                               if s.scope == "task" and n.startswith("lease_")} == names.TASK_ONLY
    assert {n: s.fix for n, s in rows.items()} == names.FIXES


def test_the_settings_page_is_the_table() -> None:
    """The page holds the table rendered from lease_celery's; a row changed in lease_celery
    and not on the page is named (and fails the docs build: the hook raises)."""
    hooks = docs_hooks()
    assert hooks.page_table() == hooks.render()
    assert hooks.problems() == []
    ttl = catalog.by_name("lease_ttl")
    changed = dataclasses.replace(ttl, meaning="seconds, changed")
    hooks.ROWS["lease_ttl"] = (changed.rendered_default(), changed.meaning)
    assert any("settings.md: its table is not the one" in p for p in hooks.problems())
    with pytest.raises(Exception, match="disagree"):
        hooks.on_page_markdown(hooks.PAGE.read_text())
