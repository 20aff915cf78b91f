"""Settings of the example shop: everything embedded under SHOP_DATA_DIR (a SQLite database
that is also the lease store, kombu's filesystem broker, file results), nothing to install."""

from __future__ import annotations

import os

DATA_DIR = os.path.abspath(os.environ.get("SHOP_DATA_DIR", "shop-data"))

SECRET_KEY = "example-only-not-secret"
DEBUG = True
ALLOWED_HOSTS = ["127.0.0.1", "localhost"]
INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    # The lease store's tables (migrations), the django:// store and the admin pages.
    "lease_celery.contrib.django",
    "examples.django_shop.shop",
]
MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
ROOT_URLCONF = "examples.django_shop.shop_site.urls"
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
        "NAME": os.path.join(DATA_DIR, "shop.sqlite3"),
        # Several worker processes write this file: wait for the lock, and take it at the
        # start of every transaction (no deadlock between two readers turning writers).
        "OPTIONS": {"timeout": 20, "transaction_mode": "IMMEDIATE"},
    },
}
USE_TZ = True
TIME_ZONE = "UTC"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
STATIC_URL = "/static/"

# The lease store is the project's own database: the admin reads it, the tasks write their
# models and their finish in one transaction.
LEASE_CELERY_STORE_URL = "django://default"
# The admin's requeue and limit actions publish with the project's app.
LEASE_CELERY_APP = "examples.django_shop.shop_site.celery:app"

CELERY_BROKER_URL = "filesystem://"
CELERY_BROKER_TRANSPORT = "example_project.broker:Transport"  # kombu's, written atomically
CELERY_BROKER_TRANSPORT_OPTIONS = {
    "data_folder_in": os.path.join(DATA_DIR, "broker"),
    "data_folder_out": os.path.join(DATA_DIR, "broker"),
    "control_folder": os.path.join(DATA_DIR, "broker-control"),
    "polling_interval": 0.1,
}
CELERY_RESULT_BACKEND = f"file://{os.path.join(DATA_DIR, 'results')}"
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_LEASE_STORE_URL = LEASE_CELERY_STORE_URL
# Short, so that the story's takeovers happen in seconds.
CELERY_LEASE_TTL = 2.0
CELERY_LEASE_HEARTBEAT_INTERVAL = 0.5
CELERY_LEASE_SWEEP_INTERVAL = 0.5
CELERY_LEASE_SWEEP_GRACE = 1.0
CELERY_WORKER_HIJACK_ROOT_LOGGER = False
