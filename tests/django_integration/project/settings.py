"""Settings of the Django project the Django integration's tests run (tests/django_integration).

Its databases come from the environment the tests set: ``default`` a SQLite file
(LEASE_TEST_DJANGO_SQLITE), ``pg`` a PostgreSQL database (LEASE_TEST_DJANGO_PG) and ``my`` a
MariaDB database (LEASE_TEST_DJANGO_MYSQL) when given. The lease store is
``LEASE_TEST_STORE`` (django://default, django://pg or django://my).
"""

from __future__ import annotations

import os

SECRET_KEY = "lease-celery-tests-only"
DEBUG = False
ALLOWED_HOSTS = ["127.0.0.1", "localhost", "testserver"]
INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "lease_celery.contrib.django",
    "tests.django_integration.project.shop",
]
MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
ROOT_URLCONF = "tests.django_integration.project.urls"
TEMPLATES = [{
    "BACKEND": "django.template.backends.django.DjangoTemplates",
    "APP_DIRS": True,
    "OPTIONS": {"context_processors": [
        "django.template.context_processors.request",
        "django.contrib.auth.context_processors.auth",
        "django.contrib.messages.context_processors.messages",
    ]},
}]
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": os.environ.get("LEASE_TEST_DJANGO_SQLITE", "django-tests.sqlite3"),
        # The workers and the test write to one file: wait for the lock instead of failing.
        "OPTIONS": {"timeout": 20},
    },
}
if os.environ.get("LEASE_TEST_DJANGO_BARE"):  # a database nobody migrated
    DATABASES["bare"] = {"ENGINE": "django.db.backends.sqlite3",
                         "NAME": os.environ["LEASE_TEST_DJANGO_BARE"]}
if os.environ.get("LEASE_TEST_DJANGO_PG"):
    DATABASES["pg"] = {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": os.environ["LEASE_TEST_DJANGO_PG"],
        "HOST": os.environ.get("LEASE_TEST_DJANGO_PG_HOST", "127.0.0.1"),
        "PORT": os.environ.get("LEASE_TEST_DJANGO_PG_PORT", "5432"),
        "USER": os.environ.get("LEASE_TEST_DJANGO_PG_USER", ""),
    }
    # The same database, for a project whose own transactions are SERIALIZABLE (psycopg's
    # IsolationLevel.SERIALIZABLE): the store's statements still run under READ COMMITTED.
    DATABASES["pg_serializable"] = {**DATABASES["pg"], "OPTIONS": {"isolation_level": 4}}
if os.environ.get("LEASE_TEST_DJANGO_PSYCOPG2"):
    # A project on psycopg2: Django's backend picks psycopg 3 whenever it can import it, and
    # the lease store's own connections need psycopg 3 installed beside psycopg2. The backend
    # is imported here with psycopg hidden, so it settles on psycopg2 for this process.
    import sys

    hidden = {name: module for name, module in sys.modules.items()
              if name == "psycopg" or name.startswith("psycopg.")}
    for name in hidden:
        del sys.modules[name]
    sys.modules["psycopg"] = None  # type: ignore[assignment]  # an ImportError for Django
    try:
        import django.db.backends.postgresql.base  # noqa: F401
    finally:
        del sys.modules["psycopg"]
        sys.modules.update(hidden)
if os.environ.get("LEASE_TEST_DJANGO_MYSQL"):
    # MariaDB through Django's MySQL backend on mysqlclient (what Django projects run; the
    # lease store's own connections are PyMySQL's), with the OPTIONS Django's docs advise.
    DATABASES["my"] = {
        "ENGINE": "django.db.backends.mysql",
        "NAME": os.environ["LEASE_TEST_DJANGO_MYSQL"],
        "HOST": os.environ.get("LEASE_TEST_DJANGO_MYSQL_HOST", "127.0.0.1"),
        "PORT": os.environ.get("LEASE_TEST_DJANGO_MYSQL_PORT", "3306"),
        "USER": os.environ.get("LEASE_TEST_DJANGO_MYSQL_USER", "root"),
        "PASSWORD": os.environ.get("LEASE_TEST_DJANGO_MYSQL_PASSWORD", ""),
        "OPTIONS": {"charset": "utf8mb4",
                    "init_command": "SET SESSION sql_mode = 'STRICT_TRANS_TABLES'"},
    }
USE_TZ = True
TIME_ZONE = "UTC"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
STATIC_URL = "/static/"

LEASE_CELERY_STORE_URL = os.environ.get("LEASE_TEST_STORE", "django://default")

CELERY_BROKER_URL = os.environ.get("LEASE_TEST_BROKER", "redis://127.0.0.1:6379/11")
CELERY_RESULT_BACKEND = CELERY_BROKER_URL
CELERY_TASK_DEFAULT_QUEUE = os.environ.get("LEASE_TEST_QUEUE", "lease-django-tests")
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_BROKER_TRANSPORT_OPTIONS = {"visibility_timeout": 3600, "unacked_restore_interval": 1,
                                   "unacked_restore_throttle": 1}
CELERY_LEASE_STORE_URL = LEASE_CELERY_STORE_URL
CELERY_LEASE_TTL = float(os.environ.get("LEASE_TEST_TTL", "2"))
CELERY_LEASE_HEARTBEAT_INTERVAL = float(os.environ.get("LEASE_TEST_HEARTBEAT", "0.5"))
CELERY_WORKER_HIJACK_ROOT_LOGGER = False
# The sweeper (re-publishes a killed worker's keys, and an outbox row whose publish never
# happened) on short periods, as the worker tests need.
CELERY_LEASE_SWEEP_INTERVAL = float(os.environ.get("LEASE_TEST_SWEEP_INTERVAL", "0.5"))
CELERY_LEASE_SWEEP_GRACE = float(os.environ.get("LEASE_TEST_SWEEP_GRACE", "2"))
