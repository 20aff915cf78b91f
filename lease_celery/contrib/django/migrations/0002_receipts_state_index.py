"""The lease store's schema 8 (the receipts' state index, which the admin's receipts list
filtered by state reads), made by the store's own statements as 0001 made schema 7."""

from __future__ import annotations

from typing import Any

from django.db import migrations

from lease_celery.contrib.django.schema import create_store_schema

#: The store schema version this migration leaves (see 0001_initial).
STORE_SCHEMA_VERSION = 8


def migrate_schema(apps: Any, schema_editor: Any) -> None:
    create_store_schema(schema_editor)


class Migration(migrations.Migration):
    dependencies = [("lease_celery", "0001_initial")]

    operations = [
        # Unapplied, nothing changes, as with 0001: the store's steps only add, and the
        # database keeps saying schema 8 (which a lease_celery of schema 7 refuses).
        migrations.RunPython(migrate_schema, migrations.RunPython.noop, elidable=False),
    ]
