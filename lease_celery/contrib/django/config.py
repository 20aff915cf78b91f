"""What ``django://ALIAS`` URLs say, and the schema version a Django database must have."""

from __future__ import annotations

from urllib.parse import urlsplit

from ...errors import ConfigError, StoreError
from ...stores.sql_glue import SCHEMA_VERSION, check_schema_version
from ...stores.urls import url_options

__all__ = ["MYSQL_OPTIONS", "PG_OPTIONS", "SQLITE_OPTIONS", "check_version", "parse_url"]

PG_OPTIONS = ("pool_max", "reconnect_timeout")
SQLITE_OPTIONS = ("busy_timeout", "synchronous")
MYSQL_OPTIONS = ("pool_max", "reconnect_timeout", "lock_wait_timeout", "connect_timeout")


def parse_url(url: str) -> tuple[str, dict[str, str]]:
    """``(alias, options)`` of ``django://ALIAS?options``, or ``ConfigError`` naming the
    problem (no Django settings are read)."""
    parts = urlsplit(url)
    if parts.scheme != "django" or not url.startswith("django://"):
        raise ConfigError(f"django store URL {url!r} must be django://ALIAS")
    alias = parts.netloc
    if not alias or parts.path not in ("", "/"):
        raise ConfigError(f"django store URL {url!r} must name a DATABASES alias and nothing "
                          "else: django://default")
    options = url_options("django", parts, url,
                          tuple(dict.fromkeys(PG_OPTIONS + SQLITE_OPTIONS + MYSQL_OPTIONS)))
    return alias, options


def _migrate_hint(alias: str) -> str:
    return (f"run `manage.py migrate lease_celery --database {alias}` (with "
            "'lease_celery.contrib.django' in INSTALLED_APPS)")


def check_version(found: int | None, alias: str) -> None:
    """The database's schema is the one this lease_celery runs on, else ``StoreError``
    telling what to run."""
    where = f"Django database {alias!r}"
    if found is None:
        raise StoreError(f"{where} has no lease tables: {_migrate_hint(alias)}")
    check_schema_version(found, where)
    if found < SCHEMA_VERSION:
        raise StoreError(f"{where} has lease schema version {found}, older than this "
                         f"lease_celery's ({SCHEMA_VERSION}): {_migrate_hint(alias)}")
