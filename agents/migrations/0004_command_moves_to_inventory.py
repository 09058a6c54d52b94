# The command outbox moves below placement, to inventory (inventory 0006): state
# only, so the table agents_command and its rows stay where they are.

from django.db import migrations


class Migration(migrations.Migration):
    dependencies = [
        ("agents", "0003_credential_join_nonce"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[migrations.DeleteModel(name="Command")],
            database_operations=[],
        ),
    ]
