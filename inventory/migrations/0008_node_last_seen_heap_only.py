"""A lease's renewal is a heap-only update: last_seen loses its index, the node table keeps room on its pages.

Every lease writes last_seen and unreachable_since. With an index on
last_seen each renewal was a new row version in all seven of the table's
indexes; with none on the columns it writes, PostgreSQL updates the row in
place on its page (a heap-only tuple) when the page has room, which the
fillfactor leaves. The embedded default (SQLite) has no such setting.
"""

from django.db import migrations, models

FILLFACTOR = 70


def leave_room(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(f"ALTER TABLE inventory_node SET (fillfactor = {FILLFACTOR})")


def take_room_back(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute("ALTER TABLE inventory_node RESET (fillfactor)")


class Migration(migrations.Migration):
    dependencies = [
        ("inventory", "0007_nodeevent_outlives_node"),
    ]

    operations = [
        migrations.AlterField(
            model_name="node",
            name="last_seen",
            field=models.DateTimeField(blank=True, null=True),
        ),
        migrations.RunPython(leave_room, take_room_back),
    ]
