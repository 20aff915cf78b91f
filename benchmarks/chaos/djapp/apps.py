from django.apps import AppConfig


class ChaosShopConfig(AppConfig):
    name = "benchmarks.chaos.djapp"
    label = "chaos_shop"
    default_auto_field = "django.db.models.BigAutoField"
