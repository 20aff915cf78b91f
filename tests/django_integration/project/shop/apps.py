from django.apps import AppConfig


class ShopConfig(AppConfig):
    name = "tests.django_integration.project.shop"
    label = "shop"
    default_auto_field = "django.db.models.BigAutoField"
