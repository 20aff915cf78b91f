from django.contrib import admin

from .models import Attempt, Order, Payment


class PaymentInline(admin.TabularInline):
    model = Payment
    extra = 0


@admin.register(Order)
class OrderAdmin(admin.ModelAdmin):
    list_display = ("number", "amount", "paid_token")
    inlines = [PaymentInline]


@admin.register(Attempt)
class AttemptAdmin(admin.ModelAdmin):
    list_display = ("order", "token", "pid", "outcome", "at")
    list_filter = ("outcome",)
