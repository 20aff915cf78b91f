"""A Django shop whose orders are paid by a leased Celery task (``python -m
examples.django_shop``): see README.md beside this file."""
