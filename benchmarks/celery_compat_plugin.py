"""The pytest plugin of ``benchmarks.celery_compat``, loaded (``-p``) in both of its runs of
Celery's integration tests.

In both modes it points the tests' own Redis helper (``t.integration.tasks.
get_redis_connection``, which Celery hard-wires to database 0) at the run's database, so
that the keys the tasks and tests write there are flushed with it and never meet another
run's. In the ``leased`` mode it also makes every app the tests create a lease_celery app:
``celery.contrib.testing.app.TestApp``, which ``celery.contrib.pytest`` calls for the session
app (the worker's) and for each test's app, is wrapped so that the app's ``task_cls`` is
``LeasedTask`` (every ``@shared_task`` of the tests becomes one, keyed by its task id) and its
``lease_store_url`` the given store.

At the end it writes a JSON marker (``--compat-marker``): the mode, how many apps were
created and how many of them had a ``LeasedTask`` base, so that a leased run that silently
ran plain tasks shows, and whether the tests and the tasks both used the run's Redis helper.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

__all__ = ["LEASED_TASK_CLS"]

#: The ``task_cls`` of the leased mode's apps.
LEASED_TASK_CLS = "lease_celery.task:LeasedTask"

_created = {"apps": 0, "leased_apps": 0}
#: The Redis helper put in place of Celery's (empty without --compat-redis-url).
_helper: list[Callable[[], Any]] = []


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("celery_compat", "lease_celery's run of Celery's integration tests")
    group.addoption("--compat-mode", choices=("plain", "leased"), default="plain",
                    help="plain: the tests as Celery ships them; leased: every task a LeasedTask")
    group.addoption("--compat-redis-url", default=None,
                    help="the run's Redis database, for the tests' own Redis helper")
    group.addoption("--compat-store-url", default=None,
                    help="lease_store_url of the leased mode's apps")
    group.addoption("--compat-marker", default=None, help="where to write the JSON marker")


def _redis_helper(url: str) -> Callable[[], Any]:
    """Celery's ``get_redis_connection``, on the database of ``url`` instead of 0."""
    from redis import StrictRedis

    def get_redis_connection() -> Any:
        # As Celery's: no socket timeout, for the tests' long blocking reads.
        return StrictRedis.from_url(url, socket_timeout=None)

    return get_redis_connection


def _leased(make_app: Callable[..., Any], store_url: str) -> Callable[..., Any]:
    """``TestApp`` whose apps have ``LeasedTask`` as their task base class and the store."""

    def leased_test_app(*args: Any, config: dict[str, Any] | None = None,
                        **kwargs: Any) -> Any:
        kwargs["task_cls"] = LEASED_TASK_CLS
        app = make_app(*args, config={**(config or {}), "lease_store_url": store_url},
                       **kwargs)
        _note(app)
        return app

    return leased_test_app


def _counting(make_app: Callable[..., Any]) -> Callable[..., Any]:
    """``TestApp`` unchanged, its apps counted (the plain mode's marker)."""

    def counted_test_app(*args: Any, **kwargs: Any) -> Any:
        app = make_app(*args, **kwargs)
        _note(app)
        return app

    return counted_test_app


def _note(app: Any) -> None:
    from lease_celery import LeasedTask

    _created["apps"] += 1
    if issubclass(app.Task, LeasedTask):
        _created["leased_apps"] += 1


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config) -> None:
    """Patch before Celery's conftest is imported (pytest imports the conftests of the paths
    it is given here, before ``pytest_configure``): the conftest binds
    ``get_redis_connection`` by name when it is imported, and the test modules take it from
    the conftest."""
    from celery.contrib.testing import app as testing_app

    options = early_config.known_args_namespace
    if options.compat_redis_url:
        from t.integration import tasks  # the run's folder is the first entry of sys.path

        _helper.append(_redis_helper(options.compat_redis_url))
        tasks.get_redis_connection = _helper[0]
    if options.compat_mode == "leased":
        if not options.compat_store_url:
            raise pytest.UsageError("--compat-mode leased needs --compat-store-url")
        testing_app.TestApp = _leased(testing_app.TestApp, options.compat_store_url)
    else:
        testing_app.TestApp = _counting(testing_app.TestApp)


def pytest_sessionfinish(session: pytest.Session) -> None:
    marker = session.config.getoption("--compat-marker")
    if marker:
        mode = session.config.getoption("--compat-mode")
        Path(marker).write_text(json.dumps({"mode": mode, **_created,
                                            "redis_helper": _helper_in_place()}))


def _helper_in_place() -> bool:
    """Whether the tasks module and Celery's conftest (where the test modules import it
    from) both call the run's Redis helper."""
    modules = [sys.modules.get(name) for name in ("t.integration.tasks",
                                                  "t.integration.conftest")]
    return bool(_helper) and all(
        module is not None and module.get_redis_connection is _helper[0] for module in modules)
