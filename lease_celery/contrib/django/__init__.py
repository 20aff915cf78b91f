"""lease_celery in a Django project: ``pip install 'lease-celery[django]'``, then add
``"lease_celery.contrib.django"`` to ``INSTALLED_APPS`` and run ``manage.py migrate``.

- ``lease_store_url = "django://default"`` (any alias of ``DATABASES``): the SQL store of
  that database, on connections made by Django's backend for it (PostgreSQL with psycopg 3,
  SQLite); the schema is the migrations' (``LEASE_CELERY_SCHEMA`` names the PostgreSQL
  schema, default ``public``).
- The admin: leases, effect receipts, each key's history and the key-group limits, with the
  operator actions of :mod:`lease_celery.ops` behind Django permissions.
- :class:`~lease_celery.contrib.django.task.LeasedDjangoTask`: ``LeasedTask`` with Celery's
  ``DjangoTask`` (``delay_on_commit``).

Nothing here is imported by ``import lease_celery``.
"""

from ...extras import needs

# Every module of the app imports Django: without it, any of them (and a django:// store
# URL) is one ImportError naming the extra to install.
with needs("lease_celery.contrib.django", "Django", extra="django"):
    import django  # noqa: F401
