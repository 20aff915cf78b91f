"""A shop: orders, and the payment each one must get exactly once."""

from __future__ import annotations

from django.db import models


class Order(models.Model):
    number = models.TextField(unique=True)
    amount = models.IntegerField()
    paid_token = models.BigIntegerField(null=True)  # the lease token of the accepted payment

    class Meta:
        app_label = "shop"


class Payment(models.Model):
    """One row per payment written; a key paid twice would have two."""

    order = models.ForeignKey(Order, on_delete=models.CASCADE)
    token = models.BigIntegerField()
    worker = models.TextField()

    class Meta:
        app_label = "shop"
