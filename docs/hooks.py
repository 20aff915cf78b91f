"""mkdocs hook (``hooks:`` in mkdocs.yml): the settings page and the settings table agree.

The table is lease_celery's own (``lease_celery.catalog.SETTINGS``: each name, where it may be
set, its default and meaning); the page (docs/reference/settings.md) holds the table rendered
from it between two markers, so the page reads the same on GitHub as on the site. The build
fails when the page and the table disagree (and so does tests/unit/test_docs_settings.py);
``python docs/hooks.py`` writes the table into the page again.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

MARKER = "<!-- lease-settings-table -->"
END = "<!-- /lease-settings-table -->"
PAGE = Path(__file__).resolve().parent / "reference" / "settings.md"


def _rows() -> dict[str, tuple[str, str]]:
    from lease_celery.catalog import SETTINGS

    return {s.name: (s.rendered_default(), s.meaning) for s in SETTINGS}


#: name -> (default as shown, meaning), in the table's order: derived from the table.
ROWS: dict[str, tuple[str, str]] = _rows()


def scopes() -> dict[str, str]:
    """Every name lease_celery reads -> ``both`` | ``task`` | ``app``, from
    ``lease_celery.names`` (what doctor checks settings and task options against) and the
    table's task-only options that are not ``lease_*`` names."""
    from lease_celery import names
    from lease_celery.catalog import SETTINGS

    found = {name: "both" for name in names.TASK_OR_APP}
    found.update({s.name: "task" for s in SETTINGS if s.scope == "task"})
    found.update({name: "app" for name in names.APP_ONLY})
    return found


def documented() -> list[str]:
    """Every name the table has a row for, in the table's order."""
    return list(ROWS)


def problems() -> list[str]:
    """How the rows, what lease_celery reads and the page differ (empty when they agree)."""
    known, rows = scopes(), documented()
    found = [f"{name}: lease_celery reads it, the settings table has no row for it"
             for name in sorted(set(known) - set(rows))]
    found += [f"{name}: a row of the settings table, but lease_celery does not read it"
              for name in sorted(set(rows) - set(known))]
    if not found and page_table() != render_rows():
        found.append(f"{PAGE.name}: its table is not the one lease_celery's settings table "
                     "renders (run python docs/hooks.py to write it again)")
    return found


def render_rows() -> str:
    """The table, in Markdown: setting | where | default | takes | meaning ("takes": what
    a refusal says the setting takes, and whether it takes it as text, as an environment
    variable gives it)."""
    from lease_celery.catalog import SCOPES, by_name

    known = scopes()
    lines = ["| setting | where | default | takes | meaning |", "| --- | --- | --- | --- | --- |"]
    for name, (default, meaning) in ROWS.items():
        where = SCOPES[known[name]] if name in known else "?"
        row = by_name(name)
        takes = row.fix + ("; also as text" if row.text else "")
        lines.append(f"| `{name}` | {where} | {default} | {takes} | {meaning} |")
    return "\n".join(lines)


def render() -> str:
    """The table as the page must hold it; ``ValueError`` when the rows and what
    lease_celery reads disagree."""
    known, rows = scopes(), documented()
    if set(known) != set(rows):
        raise ValueError("the settings table and lease_celery disagree: "
                         + "; ".join(problems()))
    return render_rows()


def page_table(text: str | None = None) -> str:
    """The table the page holds between its markers ("" when it has none)."""
    text = PAGE.read_text(encoding="utf-8") if text is None else text
    if MARKER not in text or END not in text:
        return ""
    return text.split(MARKER, 1)[1].split(END, 1)[0].strip()


def write() -> None:
    """Write the rendered table into the page, between its markers."""
    text = PAGE.read_text(encoding="utf-8")
    before, rest = text.split(MARKER, 1)
    after = rest.split(END, 1)[1] if END in rest else rest
    PAGE.write_text(f"{before}{MARKER}\n{render()}\n{END}{after}", encoding="utf-8")


def on_page_markdown(markdown: str, **_: Any) -> str:
    if MARKER not in markdown:
        return markdown
    try:
        table = render()
    except ValueError as exc:
        from mkdocs.exceptions import PluginError

        raise PluginError(str(exc)) from exc
    if page_table(markdown) != table:
        from mkdocs.exceptions import PluginError

        raise PluginError(f"{PAGE.name} and lease_celery's settings table disagree: run "
                          "python docs/hooks.py to write the table into the page again")
    return markdown


if __name__ == "__main__":
    sys.path.insert(0, str(PAGE.parents[2]))
    write()
