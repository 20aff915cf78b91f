"""Django settings of the django-celery-beat processes in tests/workers/test_beat_integrations.py:
django-celery-beat's models only, on the SQLite file LEASE_TEST_BEAT_DJANGO_DB names (each
test run makes and migrates its own)."""

from __future__ import annotations

import os

SECRET_KEY = "lease-celery-tests-only"
INSTALLED_APPS = ["django_celery_beat"]
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": os.environ.get("LEASE_TEST_BEAT_DJANGO_DB", "beat-django.sqlite3"),
        # Two beats and the test write to one file: wait for the lock instead of failing.
        "OPTIONS": {"timeout": 20},
    }
}
USE_TZ = True
TIME_ZONE = "UTC"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
