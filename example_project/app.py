"""The example's Celery app."""

from celery import Celery

app = Celery("example_project", include=["example_project.tasks"])
app.config_from_object("example_project.settings")
