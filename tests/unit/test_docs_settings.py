"""The settings table of the documentation (docs/reference/settings.md, rendered at build time by
docs/hooks.py) and what lease_celery reads cannot drift apart."""

from __future__ import annotations

from lease_celery import names, settings
from tests.support.docs import REPO, docs_hooks, rendered_rows


def test_every_setting_is_documented_and_nothing_else() -> None:
    """Both ways: each name lease_celery reads (lease_celery.names, plus the task's
    ``permanent_errors``) has a row, and each row names one it reads."""
    hooks = docs_hooks()
    assert hooks.problems() == []
    read = names.TASK_OR_APP | names.TASK_ONLY | names.APP_ONLY | {"permanent_errors"}
    assert set(rendered_rows()) == read


def test_each_row_says_where_the_setting_goes() -> None:
    """The scope column is what doctor enforces: app-wide only, task option only, or both."""
    expected = {**{n: "app, or per task" for n in names.TASK_OR_APP},
                **{n: "task option only" for n in names.TASK_ONLY | {"permanent_errors"}},
                **{n: "app-wide only" for n in names.APP_ONLY}}
    assert {name: where for name, (where, _) in rendered_rows().items()} == expected


def test_the_defaults_are_lease_celerys() -> None:
    """The defaults that are constants in lease_celery.settings are shown as they are."""
    rows = rendered_rows()
    assert rows["lease_store_url"][1].startswith(f"`{settings.DEFAULT_STORE_URL}`")
    assert rows["lease_ttl"][1] == f"`{settings.DEFAULT_TTL:g}`"
    assert rows["lease_max_attempts"][1] == f"`{settings.POLICY_DEFAULTS['max_attempts']:g}`"
    assert rows["lease_retention"][1].startswith(f"`{settings.DEFAULT_RETENTION:.0f}`")


def test_a_drift_is_named() -> None:
    """A setting lease_celery reads without a row, or a row for a name it does not read, is
    reported by name (and fails the build: the hook raises)."""
    hooks = docs_hooks()
    hooks.ROWS["lease_not_a_setting"] = ("`1`", "nothing")
    del hooks.ROWS["lease_ttl"]
    found = hooks.problems()
    assert any(p.startswith("lease_ttl: lease_celery reads it") for p in found), found
    assert any(p.startswith("lease_not_a_setting: a row") for p in found), found


def test_the_settings_page_asks_for_the_table() -> None:
    page = (REPO / "docs" / "reference" / "settings.md").read_text()
    assert docs_hooks().MARKER in page
