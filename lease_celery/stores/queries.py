"""Named SQL queries, one file per dialect, loaded with importlib.resources.

A file holds blocks that start with a ``-- name: <query>`` line; the text up to the next such
line is the query. Keeping SQL in files lets a reader review every statement in one place.
"""

from __future__ import annotations

import functools
import re
from importlib import resources

__all__ = ["load_queries"]

_NAME_LINE = re.compile(r"^-- name: (?P<name>[a-z_]+)\s*$", re.MULTILINE)


@functools.cache
def load_queries(dialect: str) -> dict[str, str]:
    """Return ``{name: text}`` from ``sql/<dialect>.sql``."""
    sql_dir = resources.files(__package__).joinpath("sql")
    text = sql_dir.joinpath(f"{dialect}.sql").read_text("utf-8")
    parts = _NAME_LINE.split(text)
    # parts = [preamble, name1, body1, name2, body2, ...]
    return {name: body.strip() for name, body in zip(parts[1::2], parts[2::2], strict=True)}
