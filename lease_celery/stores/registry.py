"""Store URLs to Store classes: ``open_store(url)`` and the scheme registry."""

from __future__ import annotations

import importlib
import threading
from urllib.parse import urlsplit

from ..errors import ConfigError, LeaseError
from .base import Clock, Store
from .urls import redact

__all__ = ["open_store", "register_scheme", "shared_store", "store_class"]


# scheme -> "module:Class", imported lazily so optional drivers stay optional.
_SCHEMES: dict[str, str] = {
    "sqlite": "lease_celery.stores.sqlite:SQLiteStore",
    "postgresql": "lease_celery.stores.postgres:PostgresStore",
    "postgres": "lease_celery.stores.postgres:PostgresStore",
    "mysql": "lease_celery.stores.mysql:MySQLStore",
    "mariadb": "lease_celery.stores.mysql:MySQLStore",
    "redis": "lease_celery.stores.redis:RedisStore",
    "rediss": "lease_celery.stores.redis:RedisStore",
    # django://ALIAS: the SQL store of that Django database (lease_celery.contrib.django);
    # imported only when such a URL is opened, so the core imports no Django.
    "django": "lease_celery.contrib.django.store:DjangoStore",
}


def register_scheme(scheme: str, target: str) -> None:
    """Map a URL scheme to ``"module:Class"``; the class is built as ``Class(url, clock=...)``."""
    _SCHEMES[scheme] = target


def store_class(url: object) -> type[Store]:
    """The Store class for ``url``'s scheme, or ``ConfigError`` naming the problem."""
    if not isinstance(url, str) or not url:
        raise ConfigError(f"lease store URL must be a non-empty string, got {url!r}")
    try:
        scheme = urlsplit(url).scheme.split("+", 1)[0].lower()
    except ValueError as exc:  # "Invalid IPv6 URL"
        raise ConfigError(f"lease store URL {redact(url)!r} is not a URL: {exc}") from exc
    target = _SCHEMES.get(scheme)
    if target is None:
        known = ", ".join(sorted(f"{s}://" for s in _SCHEMES))
        raise ConfigError(f"unknown lease store URL scheme {scheme + '://' if scheme else url!r}"
                          f" in {redact(url)!r}; known schemes: {known}")
    module_name, class_name = target.split(":")
    found: type[Store] = getattr(importlib.import_module(module_name), class_name)
    return found


def open_store(url: str, *, clock: Clock | None = None) -> Store:
    """Open the lease store named by ``url``.

    ``sqlite:///relative/path``, ``sqlite:////absolute/path`` or ``sqlite://`` (in memory).
    ``clock`` replaces the store's authority clock (tests, simulations): a callable returning
    epoch seconds.
    """
    klass = store_class(url)
    try:
        return klass(url, clock=clock)
    except LeaseError:
        raise
    except ValueError as exc:  # urllib and os on a URL that is no URL (a bad IPv6 host, NUL)
        raise ConfigError(f"lease store URL {redact(url)!r} is not usable: {exc}") from exc


_shared: dict[str, Store] = {}
_shared_lock = threading.Lock()


def share_store(store: Store) -> None:
    """Make ``store`` the one ``shared_store(store.url)`` returns in this process (tests: a
    scratch store with a manual clock, ``lease_celery.testing.scratch_leases``)."""
    with _shared_lock:
        _shared[store.url] = store


def unshare_store(url: str) -> None:
    """Forget the shared store of ``url`` (not closing it)."""
    with _shared_lock:
        _shared.pop(url, None)


def shared_store(url: str) -> Store:
    """One store object per URL per process, for everything in it that runs tasks (the store
    itself reconnects after fork)."""
    with _shared_lock:
        store = _shared.get(url)
        if store is None:
            store = _shared[url] = open_store(url)
        return store
