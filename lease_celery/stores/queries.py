"""Named SQL queries, one file per dialect, loaded with importlib.resources.

A file holds blocks that start with a ``-- name: <query>`` line; the text up to the next such
line is the query. Keeping SQL in files lets a reader review every statement in one place.

A block named ``fragment_<what>`` is no query but a piece of several: its text (comment lines
dropped) replaces ``{fragment_<what>}`` in the others, so a rule two statements share is
written once.
"""

from __future__ import annotations

import functools
import re
from importlib import resources

__all__ = ["load_queries", "parse_queries"]

_NAME_LINE = re.compile(r"^-- name: (?P<name>[a-z_]+)\s*$", re.MULTILINE)


@functools.cache
def load_queries(dialect: str) -> dict[str, str]:
    """Return ``{name: text}`` from ``sql/<dialect>.sql``."""
    sql_dir = resources.files(__package__).joinpath("sql")
    return parse_queries(sql_dir.joinpath(f"{dialect}.sql").read_text("utf-8"),
                         source=f"sql/{dialect}.sql")


def parse_queries(text: str, *, source: str) -> dict[str, str]:
    """``{name: text}`` of the blocks of ``text``, fragments put in; ``ValueError`` naming
    ``source`` and the query for a fragment it does not define."""
    parts = _NAME_LINE.split(text)
    # parts = [preamble, name1, body1, name2, body2, ...]
    blocks = {name: body.strip() for name, body in zip(parts[1::2], parts[2::2], strict=True)}
    fragments = {name: "\n".join(line for line in body.splitlines()
                                 if not line.startswith("--")).strip()
                 for name, body in blocks.items() if name.startswith("fragment_")}
    queries = {}
    for name, body in blocks.items():
        if name in fragments:
            continue
        for fragment, text in fragments.items():
            # Each line of the fragment at the indentation of the line that names it.
            body = re.sub(r"^([ \t]*)\{" + fragment + r"\}", lambda m, text=text: "\n".join(
                m[1] + line for line in text.splitlines()), body, flags=re.MULTILINE)
        if "{fragment_" in body:
            raise ValueError(f"{source}: query {name!r} uses a fragment the file does not "
                             "define")
        queries[name] = body
    return queries
