"""The key-group limit options: each bad value refused when the task is defined (or the app
configured), naming the option; a limited task in eager mode, and a direct call."""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery

from lease_celery import ConfigError, GroupLimit, Lease, LeasedTask, LimitReached, open_store
from lease_celery.limits import parse_rate


def make_app(store_url: str, **conf: Any) -> Celery:
    app = Celery("limits", broker="memory://", set_as_current=False)
    app.conf.update(lease_store_url=store_url, **conf)
    return app


@pytest.mark.parametrize(("options", "message"), [
    ({"lease_limit": 0}, r"lease_limit of task .* must be a whole number >= 1.*got 0"),
    ({"lease_limit": -2}, r"lease_limit of task .* must be a whole number >= 1.*got -2"),
    ({"lease_limit": 1.5}, r"lease_limit of task .* must be a whole number >= 1.*float"),
    ({"lease_limit": "two"}, r"lease_limit of task .* must be a whole number"),
    ({"lease_rate_limit": "ten"}, r"lease_rate_limit of task .* must be a rate such as "
                                  r"'10/s'.*'ten'"),
    ({"lease_rate_limit": "10/d"}, r"lease_rate_limit of task .*'10/d'"),
    ({"lease_rate_limit": "0/s"}, r"lease_rate_limit of task .* at least one start"),
    ({"lease_limit": 2, "lease_limit_key": "tenant:{tenant}"},
     r"lease_limit_key 'tenant:\{tenant\}' of task .* names \['tenant'\], which are not "
     r"parameters of the task \(account_id\)"),
    ({"lease_limit": 2, "lease_limit_key": "tenant:{0}"},
     r"lease_limit_key 'tenant:\{0\}': use named fields"),
])
def test_bad_limit_options_are_refused_when_the_task_is_defined(
        sqlite_url: str, options: dict[str, Any], message: str) -> None:
    app = make_app(sqlite_url)

    @app.task(base=LeasedTask, shared=False, **options)
    def job(account_id: str) -> None: ...

    with pytest.raises(ConfigError, match=message):
        app.finalize()  # (Celery makes the task's class here)


@pytest.mark.parametrize(("conf", "message"), [
    ({"lease_limit": 0}, r"lease_limit \(setting lease_limit\) must be a whole number >= 1"),
    ({"lease_rate_limit": "ten"}, r"lease_rate_limit \(setting lease_rate_limit\) must be a "
                                  r"rate"),
    ({"lease_limit": 2, "lease_limit_key": "tenant:{tenant}"},
     r"lease_limit_key 'tenant:\{tenant\}' of task .* names \['tenant'\]"),
])
def test_bad_limit_settings_are_refused_when_the_app_binds_the_task(
        sqlite_url: str, conf: dict[str, Any], message: str) -> None:
    app = make_app(sqlite_url, **conf)

    @app.task(base=LeasedTask, shared=False)
    def job(account_id: str) -> None: ...

    with pytest.raises(ConfigError, match=message):
        app.finalize()


def test_the_options_resolve_like_every_lease_option(sqlite_url: str) -> None:
    app = make_app(sqlite_url, lease_rate_limit="100/m")

    @app.task(base=LeasedTask, shared=False, lease_limit=3,
              lease_limit_key="account:{account_id}")
    def job(account_id: str) -> None: ...

    app.finalize()
    settings = job.lease_settings
    assert (settings.limit, settings.rate, settings.limit_key) == (
        3, parse_rate("100/m"), "account:{account_id}")
    assert settings.rate is not None and settings.rate.interval == pytest.approx(0.6)
    assert parse_rate("5").text == "5/s" and parse_rate(" 2 / h ").period == 3600.0


def test_a_limited_task_in_eager_mode_runs_while_a_slot_is_free_and_raises_when_full(
        sqlite_url: str) -> None:
    """Eager calls have no message to park: over the limit they raise ``LimitReached``
    naming the group; a direct call likewise."""
    app = make_app(sqlite_url, task_always_eager=True)

    @app.task(base=LeasedTask, shared=False, lease_key="job:{job_id}", lease_limit=1,
              lease_limit_key="account:{account}")
    def job(job_id: str, account: str) -> str:
        return f"{job_id} ran"

    app.finalize()
    assert job.delay("a", "acme").get() == "a ran"
    with open_store(sqlite_url) as store:
        holder = store.claim_limited("held", owner="elsewhere", ttl=30,
                                     limit=GroupLimit("account:acme", limit=1))
        assert isinstance(holder, Lease)
    with pytest.raises(LimitReached, match=r"limit group 'account:acme' is full \(1 running "
                                           r"of 1"):
        job.delay("b", "acme").get()
    with pytest.raises(LimitReached, match="account:acme"):
        job("c", "acme")
    assert job.delay("d", "other").get() == "d ran"  # another group is not held back
