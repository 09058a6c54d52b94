"""The control plane's end of the agent protocol: commands queued for nodes.

Credentials and join tokens live beside them (agents/credentials.py).
"""

from __future__ import annotations

import uuid

from django.db import models
from django.db.models import Q


class CommandKind(models.TextChoices):
    """The commands an agent answers (agents.wire)."""

    START_SHARD = "start_shard"
    STOP_SHARD = "stop_shard"
    SCAN_FABRIC = "scan_fabric"
    INSTALL_ENGINE = "install_engine"


class Command(models.Model):
    """A command for one node, delivered in heartbeat answers until the agent acknowledges it.

    Delivered until acknowledged and never run twice: the agent applies
    commands idempotently by id, and an acknowledged command is never sent again.
    """

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    node = models.ForeignKey("inventory.Node", on_delete=models.CASCADE, related_name="commands")
    kind = models.CharField(max_length=32, choices=CommandKind.choices)
    # The wire message (agents.wire.StartShard etc.) without its id.
    payload = models.JSONField()
    created_at = models.DateTimeField(db_index=True)
    # First and latest delivery in a heartbeat answer, and how often.
    first_delivered_at = models.DateTimeField(null=True, blank=True)
    deliveries = models.IntegerField(default=0)
    acked_at = models.DateTimeField(null=True, blank=True)
    # What the command is about, for cancelling what is no longer wanted
    # (a StartShard for a replica since released).
    shard_id = models.CharField(max_length=64, blank=True, db_index=True)

    class Meta:
        ordering = ["created_at", "id"]
        indexes = [
            models.Index(fields=["node", "created_at"], name="agents_cmd_pending", condition=Q(acked_at__isnull=True)),
        ]
        constraints = [
            models.CheckConstraint(condition=Q(kind__in=CommandKind.values), name="agents_command_kind_valid"),
        ]

    def __str__(self) -> str:
        return f"{self.kind} {self.id} for {self.node_id}"
