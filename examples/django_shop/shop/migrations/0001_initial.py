import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):
    initial = True
    dependencies: list[tuple[str, str]] = []
    operations = [
        migrations.CreateModel(
            name="Order",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True,
                                           serialize=False, verbose_name="ID")),
                ("number", models.CharField(max_length=40, unique=True)),
                ("amount", models.IntegerField()),
                ("paid_token", models.BigIntegerField(
                    help_text="the lease token that paid it", null=True)),
            ],
        ),
        migrations.CreateModel(
            name="Payment",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True,
                                           serialize=False, verbose_name="ID")),
                ("token", models.BigIntegerField()),
                ("worker", models.CharField(max_length=100)),
                ("order", models.ForeignKey(on_delete=django.db.models.deletion.CASCADE,
                                            related_name="payments", to="shop.order")),
            ],
        ),
        migrations.CreateModel(
            name="Attempt",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True,
                                           serialize=False, verbose_name="ID")),
                ("token", models.BigIntegerField()),
                ("pid", models.IntegerField()),
                ("outcome", models.CharField(max_length=20)),
                ("at", models.DateTimeField(auto_now_add=True)),
                ("order", models.ForeignKey(on_delete=django.db.models.deletion.CASCADE,
                                            related_name="attempts", to="shop.order")),
            ],
        ),
    ]
