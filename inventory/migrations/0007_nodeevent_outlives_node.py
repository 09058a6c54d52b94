"""A node's events outlive it: each names its node in node_name, and forgetting the node only nulls the link."""

import django.db.models.deletion
from django.db import migrations, models


def name_every_event(apps, schema_editor):
    NodeEvent = apps.get_model("inventory", "NodeEvent")
    NodeEvent.objects.filter(node_name="").update(node_name=models.F("node_id"))


class Migration(migrations.Migration):
    dependencies = [
        ("inventory", "0006_command"),
    ]

    operations = [
        migrations.AddField(
            model_name="nodeevent",
            name="node_name",
            field=models.CharField(default="", max_length=253),
            preserve_default=False,
        ),
        migrations.RunPython(name_every_event, migrations.RunPython.noop),
        migrations.AlterField(
            model_name="nodeevent",
            name="node",
            field=models.ForeignKey(
                blank=True,
                null=True,
                on_delete=django.db.models.deletion.SET_NULL,
                related_name="events",
                to="inventory.node",
            ),
        ),
        migrations.AddConstraint(
            model_name="nodeevent",
            constraint=models.CheckConstraint(
                condition=models.Q(("node_name", ""), _negated=True), name="inventory_nodeevent_names_its_node"
            ),
        ),
    ]
