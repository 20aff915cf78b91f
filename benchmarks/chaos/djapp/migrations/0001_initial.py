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
                ("job", models.TextField(db_index=True)),
                ("token", models.BigIntegerField()),
                ("pid", models.IntegerField()),
                ("task_id", models.TextField()),
            ],
        ),
        migrations.CreateModel(
            name="Payment",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True,
                                           serialize=False, verbose_name="ID")),
                ("token", models.BigIntegerField()),
                ("order", models.ForeignKey(on_delete=models.deletion.CASCADE,
                                            to="chaos_shop.order")),
            ],
        ),
    ]
