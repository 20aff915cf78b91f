"""A minimal Django project for django-celery-beat's DatabaseScheduler in the beat tests."""
