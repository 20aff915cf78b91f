"""The lease store's schema, version 7, made by the store's own statements; the models over
it are unmanaged (the admin's read-only views)."""

from __future__ import annotations

from typing import Any

from django.db import migrations, models

from lease_celery.contrib.django.schema import create_store_schema, table_name

#: The store schema version this migration leaves (sql_glue.SCHEMA_VERSION when it was
#: written). A new store schema needs a new migration that runs create_store_schema again,
#: and sets its own STORE_SCHEMA_VERSION: tests/django checks the latest one is current.
STORE_SCHEMA_VERSION = 7


def make_schema(apps: Any, schema_editor: Any) -> None:
    create_store_schema(schema_editor)


class Migration(migrations.Migration):
    initial = True
    dependencies: list[tuple[str, str]] = []

    operations = [
        # The tables stay when this is unapplied: they hold every key's token, which must
        # never restart (dropping them is a decision for an operator, not a migration).
        migrations.RunPython(make_schema, migrations.RunPython.noop, elidable=False),
        migrations.CreateModel(
            name="Lease",
            fields=[
                ("key", models.TextField(primary_key=True, serialize=False)),
                ("state", models.TextField(choices=[
                    ("ready", "ready"), ("running", "running"), ("done", "done"),
                    ("dead", "dead")])),
                ("owner", models.TextField(null=True)),
                ("token", models.BigIntegerField()),
                ("expires_at", models.FloatField(null=True)),
                ("attempts", models.IntegerField()),
                ("takeovers", models.IntegerField()),
                ("not_before", models.FloatField(null=True)),
                ("reason", models.TextField(null=True)),
                ("task", models.TextField(null=True)),
                ("result", models.TextField(null=True)),
                ("updated_at", models.FloatField()),
                ("fence", models.BigIntegerField()),
                ("settling", models.BooleanField()),
                ("checkpoint", models.TextField(null=True)),
                ("cancel", models.TextField(null=True)),
                ("grp", models.TextField(null=True, verbose_name="limit group")),
            ],
            options={
                "managed": False,
                "db_table": table_name("lease_celery_leases"),
                "default_permissions": ("view",),
                "permissions": [("release_lease", "Can release a running lease"),
                                ("requeue_lease", "Can requeue a dead lease"),
                                ("cancel_lease", "Can cancel a lease")],
            },
        ),
        migrations.CreateModel(
            name="Receipt",
            fields=[
                ("key", models.TextField(primary_key=True, serialize=False)),
                ("fingerprint", models.TextField()),
                ("state", models.TextField(choices=[
                    ("in_flight", "in flight"), ("done", "done"),
                    ("needs_reconciliation", "needs reconciliation")])),
                ("lease_key", models.TextField(null=True)),
                ("lease_token", models.BigIntegerField(null=True)),
                ("lease_owner", models.TextField(null=True)),
                ("started_at", models.FloatField()),
                ("attempts", models.IntegerField()),
                ("result", models.TextField(null=True)),
                ("version", models.BigIntegerField()),
                ("updated_at", models.FloatField()),
            ],
            options={
                "verbose_name": "effect receipt",
                "managed": False,
                "db_table": table_name("lease_celery_effects"),
                "default_permissions": ("view",),
                "permissions": [
                    ("resolve_receipt", "Can resolve an effect receipt (it happened)"),
                    ("discard_receipt", "Can discard an effect receipt (it did not happen)")],
            },
        ),
        migrations.CreateModel(
            name="HistoryEntry",
            fields=[
                ("id", models.BigAutoField(primary_key=True, serialize=False)),
                ("key", models.TextField()),
                ("at", models.FloatField()),
                ("event", models.TextField()),
                ("owner", models.TextField(null=True)),
                ("token", models.BigIntegerField(null=True)),
                ("fence", models.BigIntegerField(null=True)),
                ("detail", models.TextField(null=True)),
            ],
            options={
                "verbose_name": "history entry",
                "verbose_name_plural": "history",
                "managed": False,
                "db_table": table_name("lease_celery_history"),
                "default_permissions": ("view",),
            },
        ),
        migrations.CreateModel(
            name="LimitGroup",
            fields=[
                ("grp", models.TextField(primary_key=True, serialize=False,
                                         verbose_name="group")),
                ("task_limit", models.IntegerField(null=True)),
                ("task_rate", models.TextField(null=True)),
                ("set_limit", models.IntegerField(null=True)),
                ("set_rate", models.TextField(null=True)),
                ("slots", models.BigIntegerField()),
                ("updated_at", models.FloatField()),
            ],
            options={
                "verbose_name": "key-group limit",
                "managed": False,
                "db_table": table_name("lease_celery_limits"),
                "default_permissions": ("view",),
                "permissions": [("set_limit", "Can change a key group's limit")],
            },
        ),
    ]
