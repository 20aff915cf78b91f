"""The project's Celery app, as a Django project writes it (settings under CELERY_)."""

from __future__ import annotations

import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.django_integration.project.settings")

from celery import Celery

app = Celery("shop")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks(["tests.django_integration.project.shop"])
