"""The documentation's settings table as the tests read it: docs/hooks.py (the mkdocs hook that
renders it at build time from lease_celery.names and lease_celery.settings), loaded by path."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[2]


def docs_hooks() -> ModuleType:
    """A fresh copy of docs/hooks.py (not a package: loaded by path)."""
    spec = importlib.util.spec_from_file_location("lease_celery_docs_hooks",
                                                  REPO / "docs" / "hooks.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rendered_rows() -> dict[str, tuple[str, str]]:
    """name -> (where, default) of every row of the rendered settings table."""
    rows: dict[str, tuple[str, str]] = {}
    for line in docs_hooks().render().splitlines()[2:]:
        cells = [cell.strip() for cell in line.strip("|").split(" | ")]
        for name in re.findall(r"`([a-z_]+)`", cells[0]):
            rows[name] = (cells[1], cells[2])
    return rows
