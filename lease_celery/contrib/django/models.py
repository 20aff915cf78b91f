"""The store's tables as read-only models for the admin.

``managed = False``: the tables are the store's (made by the migration with the store's own
statements), and only the store writes them, through :mod:`lease_celery.ops` for an operator.
A model lists only the columns the admin shows. Times are epoch seconds, as the store keeps
them; the admin renders them.
"""

from __future__ import annotations

from typing import Any

from django.db import models
from django.db.models.expressions import Col

from .schema import table_name

__all__ = ["HistoryEntry", "Lease", "LimitGroup", "Receipt"]

LEASE_STATES = [("ready", "ready"), ("running", "running"), ("done", "done"),
                ("dead", "dead")]
RECEIPT_STATES = [("in_flight", "in flight"), ("done", "done"),
                  ("needs_reconciliation", "needs reconciliation")]


class Lease(models.Model):
    key = models.TextField(primary_key=True)
    # choices: the admin's state filter then lists them without reading the table.
    state = models.TextField(choices=LEASE_STATES)
    owner = models.TextField(null=True)
    token = models.BigIntegerField()
    expires_at = models.FloatField(null=True)
    attempts = models.IntegerField()
    takeovers = models.IntegerField()
    not_before = models.FloatField(null=True)
    reason = models.TextField(null=True)
    task = models.TextField(null=True)
    result = models.TextField(null=True)
    updated_at = models.FloatField()
    fence = models.BigIntegerField()
    settling = models.BooleanField()
    checkpoint = models.TextField(null=True)
    cancel = models.TextField(null=True)
    grp = models.TextField(null=True, verbose_name="limit group")

    class Meta:
        managed = False
        db_table = table_name("lease_celery_leases")
        default_permissions = ("view",)
        permissions = [("release_lease", "Can release a running lease"),
                       ("requeue_lease", "Can requeue a dead lease"),
                       ("cancel_lease", "Can cancel a lease")]

    def __str__(self) -> str:
        return self.key


class Receipt(models.Model):
    """An effect receipt (``self.effect(...)``): the reconcile queue is its
    ``needs_reconciliation`` rows."""

    key = models.TextField(primary_key=True)
    fingerprint = models.TextField()
    state = models.TextField(choices=RECEIPT_STATES)
    lease_key = models.TextField(null=True)
    lease_token = models.BigIntegerField(null=True)
    lease_owner = models.TextField(null=True)
    started_at = models.FloatField()
    attempts = models.IntegerField()
    result = models.TextField(null=True)
    version = models.BigIntegerField()
    updated_at = models.FloatField()

    class Meta:
        managed = False
        db_table = table_name("lease_celery_effects")
        verbose_name = "effect receipt"
        default_permissions = ("view",)
        permissions = [("resolve_receipt", "Can resolve an effect receipt (it happened)"),
                       ("discard_receipt", "Can discard an effect receipt (it did not happen)")]

    def __str__(self) -> str:
        return self.key


class RowIdCol(Col):
    """The history's id column: ``id`` on PostgreSQL (a bigserial), SQLite's ``rowid`` (its
    history table has no id column of its own: the rowid is its insertion order)."""

    def as_sqlite(self, compiler: Any, connection: Any) -> tuple[str, list[Any]]:
        quote = compiler.quote_name_unless_alias
        name = "rowid"
        return (f"{quote(self.alias)}.{name}" if self.alias else name), []


class HistoryId(models.BigAutoField):
    """The history's primary key, read through :class:`RowIdCol`."""

    def get_col(self, alias: str, output_field: Any = None) -> Col:
        return RowIdCol(alias, self, output_field)

    @property
    def cached_col(self) -> Col:  # (Django's is cached; one Col per query is cheap)
        return RowIdCol(table_name("lease_celery_history"), self)


class HistoryEntry(models.Model):
    id = HistoryId(primary_key=True)
    key = models.TextField()
    at = models.FloatField()
    event = models.TextField()
    owner = models.TextField(null=True)
    token = models.BigIntegerField(null=True)
    fence = models.BigIntegerField(null=True)
    detail = models.TextField(null=True)

    class Meta:
        managed = False
        db_table = table_name("lease_celery_history")
        verbose_name = "history entry"
        verbose_name_plural = "history"
        default_permissions = ("view",)

    def __str__(self) -> str:
        return f"{self.key}: {self.event}"


class LimitGroup(models.Model):
    grp = models.TextField(primary_key=True, verbose_name="group")
    task_limit = models.IntegerField(null=True)
    task_rate = models.TextField(null=True)
    set_limit = models.IntegerField(null=True)
    set_rate = models.TextField(null=True)
    slots = models.BigIntegerField()
    updated_at = models.FloatField()

    class Meta:
        managed = False
        db_table = table_name("lease_celery_limits")
        verbose_name = "key-group limit"
        default_permissions = ("view",)
        permissions = [("set_limit", "Can change a key group's limit")]

    def __str__(self) -> str:
        return self.grp
