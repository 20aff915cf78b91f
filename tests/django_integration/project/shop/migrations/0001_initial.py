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
                ("number", models.TextField(unique=True)),
                ("amount", models.IntegerField()),
                ("paid_token", models.BigIntegerField(null=True)),
            ],
        ),
        migrations.CreateModel(
            name="Payment",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True,
                                           serialize=False, verbose_name="ID")),
                ("token", models.BigIntegerField()),
                ("worker", models.TextField()),
                ("order", models.ForeignKey(on_delete=django.db.models.deletion.CASCADE,
                                            to="shop.order")),
            ],
        ),
    ]
