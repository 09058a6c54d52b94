from django.db import migrations, models


def draining_were_told(apps, schema_editor):
    # Replicas already draining had their shards told to stop when they began to.
    Replica = apps.get_model("placement", "Replica")
    Replica.objects.filter(state="draining").update(stop_requested_at=models.F("updated_at"))


class Migration(migrations.Migration):
    dependencies = [
        ("placement", "0003_event_outlives_its_deployment"),
    ]

    operations = [
        migrations.AddField(
            model_name="replica",
            name="stop_requested_at",
            field=models.DateTimeField(blank=True, null=True),
        ),
        migrations.RunPython(draining_were_told, migrations.RunPython.noop),
    ]
