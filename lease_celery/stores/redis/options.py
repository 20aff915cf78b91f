"""The Redis store's URL options: which it hands on to redis-py, and the checks they pass.

An explicit list, not whatever redis-py accepts: an unknown option reached redis-py's
connection class as a keyword argument and failed every call with a ``TypeError``; options
the store sets itself (``decode_responses``, its retry) or cannot honour (``protocol``: the
store is written against RESP2 replies; ``max_connections``: the script caller keeps
connections of its own) would silently change what it reads back or how it retries. Every
value is checked here, so a bad one is a ``ConfigError`` naming it, raised by ``check_url``
without connecting.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import SplitResult, unquote

from ...checks import check_ttl
from ...errors import ConfigError
from ..urls import choice_option, url_options, whole_option

__all__ = ["ReplicaWait", "connection_options"]


_FLAGS = {"1": True, "t": True, "true": True, "y": True, "yes": True, "on": True,
          "0": False, "f": False, "false": False, "n": False, "no": False, "off": False}


def _seconds(name: str, raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"redis URL option {name}={raw!r} is not a number of seconds"
                          ) from None
    return check_ttl(value, name=f"redis URL option {name}")


def _flag(name: str, raw: str) -> bool:
    if raw.lower() not in _FLAGS:
        raise ConfigError(f"redis URL option {name}={raw!r} must be true or false")
    return _FLAGS[raw.lower()]


def _client_name(name: str, raw: str) -> str:
    # Redis refuses names with spaces or control characters (CLIENT SETNAME).
    if not raw or not all("!" <= c <= "~" for c in raw):
        raise ConfigError(f"redis URL option {name}={raw!r} must be a non-empty name without "
                          "spaces (printable ASCII)")
    return raw


def _text(name: str, raw: str) -> str:
    if not raw:
        raise ConfigError(f"redis URL option {name} must not be empty")
    return raw


#: redis-py connection options the store hands on, each with the check its value must pass.
_PASSED_ON: dict[str, Callable[[str, str], Any]] = {
    "db": lambda name, raw: whole_option("redis", name, raw, minimum=0),
    "socket_timeout": _seconds,
    "socket_connect_timeout": _seconds,
    "socket_keepalive": _flag,
    "health_check_interval": lambda name, raw: whole_option("redis", name, raw, minimum=0),
    "client_name": _client_name,
}
#: ... and those for TLS connections, on ``rediss://`` URLs only.
_PASSED_ON_TLS: dict[str, Callable[[str, str], Any]] = {
    "ssl_cert_reqs": lambda name, raw: choice_option(
        "redis", name, raw, ("none", "optional", "required")),
    "ssl_check_hostname": _flag,
    "ssl_ca_certs": _text,
    "ssl_ca_path": _text,
    "ssl_certfile": _text,
    "ssl_keyfile": _text,
    "ssl_password": _text,
    "ssl_ciphers": _text,
}


@dataclass(frozen=True)
class ReplicaWait:
    """``?wait_replicas=N&wait_timeout=S``: after each write that matters (claim, finish,
    kill, release, settle, effect receipts) the store sends ``WAIT N`` and answers only once N
    replicas acknowledged it, or raises ``StoreError`` after ``S`` seconds (default 1)."""

    replicas: int
    timeout: float

    @property
    def timeout_ms(self) -> int:
        return max(1, round(self.timeout * 1000))


#: The store's own options (not redis-py's).
_OWN = ("prefix", "wait_replicas", "wait_timeout")


def connection_options(parts: SplitResult, shown: str
                       ) -> tuple[str, ReplicaWait | None, dict[str, Any]]:
    """The key prefix, the replica wait (None: no ``wait_replicas``) and redis-py's keyword
    arguments from a store URL, every option checked; ``ConfigError`` naming the first that is
    unknown or whose value is bad."""
    tls = parts.scheme.lower() == "rediss"
    passed_on = {**_PASSED_ON, **(_PASSED_ON_TLS if tls else {})}
    query = url_options("redis", parts, shown, _OWN,
                        passed_on=[*_PASSED_ON, *_PASSED_ON_TLS], passed_to="redis-py")
    tls_only = sorted(set(query) - set(passed_on) - set(_OWN))
    if tls_only:
        raise ConfigError(f"redis URL option{'s' if len(tls_only) > 1 else ''} "
                          f"{', '.join(map(repr, tls_only))} in {shown!r} only apply to TLS "
                          "connections: use a rediss:// URL")
    prefix = query.pop("prefix", "lease_celery:")
    wait = _replica_wait(query.pop("wait_replicas", None), query.pop("wait_timeout", None))
    kwargs = {name: passed_on[name](name, raw) for name, raw in query.items()}
    path = unquote(parts.path).strip("/")
    if path:
        if not (path.isascii() and path.isdigit()):
            raise ConfigError(f"redis URL database {parts.path!r} in {shown!r} is not a "
                              "database number (redis://host:port/0)")
        if kwargs.setdefault("db", int(path)) != int(path):
            raise ConfigError(f"redis URL {shown!r} names database {path} in its path and "
                              f"db={kwargs['db']} in its options: give one")
    kwargs.setdefault("socket_connect_timeout", 5.0)
    kwargs.setdefault("socket_timeout", 5.0)
    return prefix, wait, kwargs


def _replica_wait(replicas: str | None, timeout: str | None) -> ReplicaWait | None:
    if replicas is None:
        if timeout is not None:
            raise ConfigError("redis URL option wait_timeout only applies with wait_replicas=N")
        return None
    count = whole_option("redis", "wait_replicas", replicas, minimum=1)
    seconds = 1.0 if timeout is None else _seconds("wait_timeout", timeout)
    return ReplicaWait(replicas=count, timeout=seconds)
