"""Settings of the ``django-tx`` chaos run's Django project (``DJANGO_SETTINGS_MODULE``).

One database, ``default``: the run's PostgreSQL schema, read from ``CHAOS_DATABASE_URL``
(``postgresql://host:port/db?schema=chaos_<run>&application_name=chaos_<run>``). The workers
reach it through the run's proxy under the run's ``application_name`` (so ``conn`` kills
Django's connections too and ``slow`` delays them); the harness's ``migrate`` directly. The
lease store is ``django://default`` with its tables in the same schema
(``LEASE_CELERY_SCHEMA``); the app's tables land there too (``search_path``), so dropping the
schema removes the whole run.
"""

from __future__ import annotations

import os
from urllib.parse import parse_qs, urlsplit

_url = urlsplit(os.environ["CHAOS_DATABASE_URL"])
_query = {name: values[-1] for name, values in parse_qs(_url.query).items()}
SCHEMA = _query["schema"]

SECRET_KEY = "lease-celery-chaos-only"
INSTALLED_APPS = ["lease_celery.contrib.django", "benchmarks.chaos.djapp"]
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": _url.path.lstrip("/"),
        "HOST": _url.hostname or "127.0.0.1",
        "PORT": str(_url.port or 5432),
        "USER": _url.username or "",
        # As a Celery project runs: connections kept across tasks (Celery's Django fixup
        # closes the unusable ones between tasks; the health check replaces one a ``conn``
        # kill broke before a task uses it).
        "CONN_MAX_AGE": 300,
        "CONN_HEALTH_CHECKS": True,
        "OPTIONS": {
            "application_name": _query.get("application_name", "chaos"),
            "options": f"-c search_path={SCHEMA}",
            "connect_timeout": 5,
        },
    },
}
LEASE_CELERY_SCHEMA = SCHEMA
USE_TZ = True
TIME_ZONE = "UTC"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
