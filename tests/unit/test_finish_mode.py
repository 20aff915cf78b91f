"""Where a finish nothing waits for is written (``LeaseSettings.finish_mode``), and which stores
carry it in the next claim's transaction."""

from __future__ import annotations

import pytest

from lease_celery.settings import BACKGROUND_AFTER, LeaseSettings
from lease_celery.stores.base import Store
from lease_celery.stores.postgres import PostgresStore
from lease_celery.stores.redis import RedisStore
from lease_celery.stores.sqlite import SQLiteStore


def _settings(value: bool | str) -> LeaseSettings:
    return LeaseSettings(store_url="sqlite://", ttl=30.0, heartbeat_interval=10.0,
                         finish_in_background=value)


@pytest.mark.parametrize(("value", "body", "carries", "mode"), [
    # "auto": a short body's finish is carried where the store makes it one transaction with
    # the next claim, written in the task elsewhere; a longer body's goes to a sender.
    ("auto", 0.0, True, "carried"),
    ("auto", 0.0, False, "inline"),
    ("auto", BACKGROUND_AFTER, True, "background"),
    ("auto", BACKGROUND_AFTER, False, "background"),
    (True, 0.0, True, "background"),
    (False, 1.0, True, "inline"),
])
def test_the_finish_mode_follows_the_setting_the_body_and_the_store(
        value: bool | str, body: float, carries: bool, mode: str) -> None:
    """The rule, case by case."""
    assert _settings(value).finish_mode(body, store_carries=carries) == mode


@pytest.mark.parametrize(("store", "carries"), [
    (SQLiteStore, True), (PostgresStore, True), (RedisStore, True), (Store, False)])
def test_the_stores_that_carry_a_finish_in_one_transaction_say_so(
        store: type[Store], carries: bool) -> None:
    """SQLite (one transaction), PostgreSQL (one statement) and Redis (one script) carry; the
    contract's default sends the two writes in turn, and so does not."""
    assert store.carries_finish is carries
