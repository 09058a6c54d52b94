# The command outbox, moved here from agents (agents 0004): state only, so the
# table keeps its name (agents_command) and its rows.

import uuid

import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("inventory", "0005_node_metrics_addr"),
        ("agents", "0004_command_moves_to_inventory"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.CreateModel(
                    name="Command",
                    fields=[
                        ("id", models.UUIDField(default=uuid.uuid4, editable=False, primary_key=True, serialize=False)),
                        (
                            "kind",
                            models.CharField(
                                choices=[
                                    ("start_shard", "Start Shard"),
                                    ("stop_shard", "Stop Shard"),
                                    ("scan_fabric", "Scan Fabric"),
                                    ("install_engine", "Install Engine"),
                                ],
                                max_length=32,
                            ),
                        ),
                        ("payload", models.JSONField()),
                        ("created_at", models.DateTimeField(db_index=True)),
                        ("first_delivered_at", models.DateTimeField(blank=True, null=True)),
                        ("deliveries", models.IntegerField(default=0)),
                        ("acked_at", models.DateTimeField(blank=True, null=True)),
                        ("shard_id", models.CharField(blank=True, db_index=True, max_length=64)),
                        (
                            "node",
                            models.ForeignKey(
                                on_delete=django.db.models.deletion.CASCADE,
                                related_name="commands",
                                to="inventory.node",
                            ),
                        ),
                    ],
                    options={
                        "db_table": "agents_command",
                        "ordering": ["created_at", "id"],
                        "indexes": [
                            models.Index(
                                condition=models.Q(("acked_at__isnull", True)),
                                fields=["node", "created_at"],
                                name="agents_cmd_pending",
                            )
                        ],
                        "constraints": [
                            models.CheckConstraint(
                                condition=models.Q(
                                    ("kind__in", ["start_shard", "stop_shard", "scan_fabric", "install_engine"])
                                ),
                                name="agents_command_kind_valid",
                            )
                        ],
                    },
                ),
            ],
            database_operations=[],
        ),
    ]
