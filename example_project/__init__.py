"""A small Celery app as a user of lease_celery would write it (see README.md here)."""
