"""What a ``django-tx`` job body writes, in one ``self.lease.atomic()`` block with its finish.

Neither table has a unique constraint on the job: a body whose writes committed twice must
leave two rows for the checker to count, not an ``IntegrityError`` that hides it.
"""

from __future__ import annotations

from django.db import models


class Order(models.Model):
    """One row per committed body: the job and the lease token it committed under."""

    job = models.TextField(db_index=True)
    token = models.BigIntegerField()
    pid = models.IntegerField()
    task_id = models.TextField()

    class Meta:
        app_label = "chaos_shop"


class Payment(models.Model):
    """The order's payment, written in a savepoint (a nested ``transaction.atomic()``) of the
    same block: it commits with its order and the finish, or not at all."""

    order = models.ForeignKey(Order, on_delete=models.CASCADE)
    token = models.BigIntegerField()

    class Meta:
        app_label = "chaos_shop"
