"""Orders, their payments (one each, ever), and every attempt a worker made at one."""

from __future__ import annotations

from django.db import models


class Order(models.Model):
    number = models.CharField(max_length=40, unique=True)
    amount = models.IntegerField()
    paid_token = models.BigIntegerField(null=True, help_text="the lease token that paid it")

    def __str__(self) -> str:
        return self.number


class Payment(models.Model):
    order = models.ForeignKey(Order, on_delete=models.CASCADE, related_name="payments")
    token = models.BigIntegerField()
    worker = models.CharField(max_length=100)


class Attempt(models.Model):
    """What each execution did, written outside the lease's transaction (so a rolled-back
    attempt is still on record): started, paid, or refused (its lease was gone)."""

    order = models.ForeignKey(Order, on_delete=models.CASCADE, related_name="attempts")
    token = models.BigIntegerField()
    pid = models.IntegerField()
    outcome = models.CharField(max_length=20)
    at = models.DateTimeField(auto_now_add=True)
