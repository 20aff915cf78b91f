"""``django://ALIAS`` on MariaDB reads its connections from the alias's settings: the
project's OPTIONS apply to the store's own (PyMySQL) connections, the store's session
settings after them; an option PyMySQL has no parameter for is refused naming it."""

from __future__ import annotations

from typing import Any

import pytest

from lease_celery import open_store
from lease_celery.errors import ConfigError

pytestmark = pytest.mark.usefixtures("django_project")


def options(monkeypatch: pytest.MonkeyPatch, **changed: Any) -> None:
    from django.db import connections

    settings = connections["my"].settings_dict
    monkeypatch.setitem(settings, "OPTIONS", {**settings["OPTIONS"], **changed})


def test_init_command_applies_and_the_stores_session_follows_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    options(monkeypatch, init_command="SET SESSION sql_mode = 'ANSI_QUOTES', "
                                      "time_zone = '+05:00'")
    store = open_store("django://my?pool_max=1")
    try:
        lease = store.claim("settings:init", owner="w", ttl=30)
        assert lease is not None
        with store.fenced(lease) as conn, conn.cursor() as cursor:
            cursor.execute("SELECT @@session.sql_mode AS mode, @@session.time_zone AS tz, "
                           "@@session.tx_isolation AS iso")
            row = cursor.fetchone()
        assert row == {"mode": "ANSI_QUOTES", "tz": "+00:00", "iso": "READ-COMMITTED"}
        assert store.finish(lease, "ok")
    finally:
        store.close()


def test_an_option_only_mysqlclient_has_is_refused_naming_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    options(monkeypatch, ssl_mode="REQUIRED")
    with pytest.raises(ConfigError, match=r"'my': .*PyMySQL.* ssl_mode of OPTIONS"):
        open_store("django://my")


def test_a_url_option_of_another_database_is_refused() -> None:
    with pytest.raises(ConfigError, match="busy_timeout"):
        open_store("django://my?busy_timeout=5")
