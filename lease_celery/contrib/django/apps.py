"""The Django app of lease_celery (``INSTALLED_APPS``: ``"lease_celery.contrib.django"``)."""

from __future__ import annotations

from django.apps import AppConfig

__all__ = ["LeaseCeleryConfig"]


class LeaseCeleryConfig(AppConfig):
    name = "lease_celery.contrib.django"
    # The permissions read lease_celery.<action>_<model> (lease_celery.release_lease).
    label = "lease_celery"
    verbose_name = "Leases (lease_celery)"
    default_auto_field = "django.db.models.BigAutoField"
