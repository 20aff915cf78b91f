"""The example's Celery app: configured from ``example_project.settings``."""

from __future__ import annotations

from celery import Celery

# The demo's timeline: signal receivers that record, from inside every worker process, what the
# workers and the leases did. An app of your own does not need this import.
from example_project import observe  # noqa: F401

app = Celery("example_project", include=["example_project.tasks"])
app.config_from_object("example_project.settings")
