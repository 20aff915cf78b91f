"""Escaping, links and the page layout: everything user data passes through on its way out.

Every string that reaches a page goes through :func:`h`, which escapes it unless it is
:class:`Safe` (HTML this package built from escaped parts). Keys, owners, reasons, results and
history details are user data: they can hold anything but NUL, ``<script>`` included.
"""

from __future__ import annotations

import html
import json
import time
import unicodedata
from collections.abc import Iterable, Sequence
from typing import Any
from urllib.parse import quote, urlencode

__all__ = ["Safe", "ago", "h", "join", "json_block", "layout", "link", "table", "url", "when"]

#: Longest JSON value (result, checkpoint, task) shown in full; longer ones are cut.
MAX_JSON_CHARS = 20_000

NAV = [("/", "Overview"), ("/running", "Running"), ("/events", "Takeovers & refusals"),
       ("/dead", "Dead"), ("/reconcile", "Reconciliation"), ("/limits", "Limits"),
       ("/key", "Find a key")]


class Safe(str):
    """HTML built by this package from escaped parts: :func:`h` passes it through."""

    __slots__ = ()


def h(value: object) -> Safe:
    """``value`` as HTML text: escaped (quotes included, so also fit for attributes), and the
    invisible characters that make text show other than it is (bidi overrides, zero-width
    and other format characters, controls but newline and tab) shown as ``\\uXXXX``: a key
    ``uni\\u202egnp.exe`` must not read as ``uniexe.png``."""
    if isinstance(value, Safe):
        return value
    return Safe(html.escape(_visible("" if value is None else str(value)), quote=True))


def _visible(text: str) -> str:
    if text.isascii() and text.isprintable():
        return text
    return "".join(f"\\u{ord(c):04x}" if c not in "\n\t"
                   and unicodedata.category(c) in ("Cf", "Cc", "Zl", "Zp") else c
                   for c in text)


def join(parts: Iterable[object], sep: str = "") -> Safe:
    return Safe(sep.join(h(part) for part in parts))


def url(base: str, path: str, **query: object) -> str:
    """``base`` + ``path`` with ``query`` percent-encoded (a key's ``/``, ``?``, ``#`` too)."""
    pairs = {name: str(value) for name, value in query.items() if value is not None}
    return base + path + ("?" + urlencode(pairs, quote_via=quote) if pairs else "")


def link(href: str, text: object, *, title: object = None, cls: str | None = None) -> Safe:
    extra = "" if title is None else f' title="{h(title)}"'
    extra += "" if cls is None else f' class="{h(cls)}"'
    return Safe(f'<a href="{h(href)}"{extra}>{h(text)}</a>')


def ago(seconds: float) -> str:
    """A duration for people: ``4s``, ``3m 05s``, ``2h 03m``, ``3d 04h``."""
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.0f}s" if seconds >= 10 else f"{seconds:.1f}s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m {secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return f"{hours}h {minutes:02d}m"
    days, hours = divmod(hours, 24)
    return f"{days}d {hours:02d}h"


def utc(at: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(at))


def when(at: float | None, now: float) -> Safe:
    """``12s ago`` / ``in 8s``, with the UTC time on hover."""
    if at is None:
        return Safe("&ndash;")
    delta = at - now
    text = f"in {ago(delta)}" if delta > 0 else f"{ago(-delta)} ago"
    return Safe(f'<time title="{h(utc(at))}">{h(text)}</time>')


def json_block(value: Any) -> Safe:
    """A JSON value, pretty-printed and escaped, in a ``<pre>``."""
    text = json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False, default=str)
    if len(text) > MAX_JSON_CHARS:
        text = text[:MAX_JSON_CHARS] + f"\n… ({len(text) - MAX_JSON_CHARS} more characters)"
    return Safe(f"<pre>{h(text)}</pre>")


def table(headers: Sequence[str], rows: Iterable[Sequence[object]], *,
          empty: str = "nothing here", cls: str = "") -> Safe:
    """A table whose cells are escaped unless :class:`Safe`."""
    body = ["<tr>" + "".join(f"<td>{h(cell)}</td>" for cell in row) + "</tr>" for row in rows]
    if not body:
        return Safe(f'<p class="empty">{h(empty)}</p>')
    head = "".join(f"<th>{h(name)}</th>" for name in headers)
    return Safe(f'<table class="{h(cls)}"><thead><tr>{head}</tr></thead>'
                f'<tbody>{"".join(body)}</tbody></table>')


def layout(title: str, body: Safe, *, base: str, path: str, refresh: int | None,
           read_only: bool, store: str) -> str:
    """The whole page. ``refresh``: seconds between reloads (never on a page with a form)."""
    here = ' class="here"'
    nav = "".join(f"<li{here if path == target else ''}>{link(url(base, target), text)}</li>"
                  for target, text in NAV)
    meta = "" if not refresh else f'<meta http-equiv="refresh" content="{int(refresh)}">'
    mode = ('<p class="mode ro">read-only: started without an operator token, so no actions'
            "</p>" if read_only else
            '<p class="mode rw">actions need the operator token</p>')
    reloads = f" · reloads every {int(refresh)}s" if refresh else ""
    return (
        "<!DOCTYPE html>\n"
        f'<html lang="en"><head><meta charset="utf-8">{meta}'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{h(title)} · lease_celery</title>"
        f'<link rel="stylesheet" href="{h(url(base, "/static/dashboard.css"))}"></head>'
        f'<body><header><p class="brand">lease_celery</p><ul class="nav">{nav}</ul>{mode}'
        f"</header><main><h1>{h(title)}</h1>{body}</main>"
        f'<footer>store {h(store)}{h(reloads)}</footer></body></html>\n')
