# Per-key token budgets per UTC day and month.

from django.conf import settings
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("gateway", "0001_api_keys_and_usage"),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.AddField(
            model_name="apikey",
            name="tokens_per_day",
            field=models.PositiveBigIntegerField(default=0, verbose_name="tokens a day (UTC)"),
        ),
        migrations.AddField(
            model_name="apikey",
            name="tokens_per_month",
            field=models.PositiveBigIntegerField(default=0, verbose_name="tokens a month (UTC)"),
        ),
        migrations.AddConstraint(
            model_name="apikey",
            constraint=models.CheckConstraint(
                condition=models.Q(("tokens_per_day__gte", 0), ("tokens_per_month__gte", 0)),
                name="gateway_apikey_budgets_not_negative",
            ),
        ),
        migrations.AddConstraint(
            model_name="apikey",
            constraint=models.CheckConstraint(
                condition=models.Q(
                    ("tokens_per_day", 0),
                    ("tokens_per_month", 0),
                    ("tokens_per_day__lte", models.F("tokens_per_month")),
                    _connector="OR",
                ),
                name="gateway_apikey_day_budget_within_month",
            ),
        ),
    ]
