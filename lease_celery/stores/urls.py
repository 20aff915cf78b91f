"""The query options of store URLs: each given once, each known, each value checked, with
messages that name the option (and never show a password)."""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from urllib.parse import SplitResult, parse_qsl, urlsplit, urlunsplit

from ..errors import ConfigError

__all__ = ["choice_option", "number_option", "redact", "server_address", "url_options",
           "whole_option"]


def redact(store_url: str) -> str:
    """The store URL as messages and pages show it: no password, no query (which may carry
    credentials)."""
    try:
        parts = urlsplit(store_url)
        password = parts.password
    except ValueError:  # not even a URL: show only its scheme
        return store_url.partition(":")[0] + "://…"
    netloc = parts.netloc
    if password is not None:
        netloc = netloc.replace(f":{password}@", ":***@", 1)
    if not netloc:
        # urlunsplit writes an empty host as none at all: "sqlite:////abs" would show as
        # "sqlite://abs" (a host) and "sqlite:///rel" as "sqlite:/rel".
        return f"{parts.scheme}://{parts.path}"
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def number_option(url: str, name: str, raw: str | None, default: float) -> float:
    """A numeric URL query option, or ``ConfigError`` naming it (``url``: the URL as shown in
    messages, without its password)."""
    if raw is None:
        return default
    try:
        return float(raw)
    except ValueError:
        raise ConfigError(f"URL option {name}={raw!r} in {url!r} is not a number") from None


def url_options(kind: str, parts: SplitResult, shown: str, known: Iterable[str], *,
                passed_on: Iterable[str] = (), passed_to: str = "") -> dict[str, str]:
    """The query options of a store URL, each given once and each known.

    ``known``: the store's own options; ``passed_on``: the driver's (``passed_to``) that the
    store hands on. Anything else, or an option given twice (the store and its driver would
    not agree on which one counts), is a ``ConfigError`` naming it, the option probably
    meant, and every known one. ``shown`` is the URL as messages show it (no password).
    """
    own, theirs = sorted(set(known)), sorted(set(passed_on) - set(known))
    options: dict[str, str] = {}
    for name, value in parse_qsl(parts.query, keep_blank_values=True):
        if name in options:
            raise ConfigError(f"{kind} URL option {name!r} is given more than once in "
                              f"{shown!r}; give it once")
        options[name] = value
    unknown = sorted(set(options) - set(own) - set(theirs))
    if unknown:
        guesses = [match for name in unknown
                   for match in difflib.get_close_matches(name, own + theirs, n=1, cutoff=0.75)]
        meant = f" (did you mean {', '.join(map(repr, guesses))}?)" if guesses else ""
        listed = ", ".join(own) + (f"; and {passed_to}'s: {', '.join(theirs)}" if theirs else "")
        raise ConfigError(f"unknown {kind} URL option{'s' if len(unknown) > 1 else ''} "
                          f"{', '.join(map(repr, unknown))} in {shown!r}{meant}; known: {listed}")
    return options


def server_address(kind: str, parts: SplitResult, default_port: int) -> str:
    """``host:port/path`` of a server store's URL (what its messages name), or ``ConfigError``
    for a port that is not a port number."""
    try:
        port = parts.port
    except ValueError:
        port = 0
    if port == 0:
        raise ConfigError(f"port {parts.netloc.rpartition(':')[2]!r} in the {kind} URL of "
                          f"host {parts.hostname!r} is not a port number (1-65535)")
    return f"{parts.hostname or 'localhost'}:{port or default_port}{parts.path or ''}"


def choice_option(kind: str, name: str, raw: str, choices: Iterable[str]) -> str:
    """``raw`` if it is one of ``choices`` (case-insensitive, returned lower-case), else
    ``ConfigError`` naming the option and the choices."""
    value = raw.lower()
    allowed = list(choices)
    if value not in allowed:
        raise ConfigError(f"{kind} URL option {name}={raw!r} must be one of "
                          f"{', '.join(allowed)}")
    return value


def whole_option(kind: str, name: str, raw: str, *, minimum: int) -> int:
    """A whole-number URL option >= ``minimum``, or ``ConfigError`` naming it."""
    try:
        value = int(raw)
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise ConfigError(f"{kind} URL option {name}={raw!r} must be a whole number >= "
                          f"{minimum}")
    return value

