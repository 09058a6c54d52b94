"""The control plane's end of the agent protocol: join tokens and node credentials (agents/credentials.py).

The commands queued for nodes are an outbox below placement: inventory.models.Command.
"""

from __future__ import annotations

from django.conf import settings
from django.db import models
from django.db.models import Q


class JoinToken(models.Model):
    """A secret that lets a new node join and receive its own credential.

    Created by an operator in the admin; only its SHA-256 is stored, so the
    secret is shown once, at creation. An expiry and an optional use limit
    bound what a leaked token can do.
    """

    name = models.CharField(max_length=128, help_text="What the token is for (a rack, a batch of nodes).")
    token_hash = models.CharField(max_length=64, unique=True, editable=False)
    # The first characters of the secret, so an operator can tell tokens apart.
    prefix = models.CharField(max_length=24, editable=False)
    expires_at = models.DateTimeField()
    max_uses = models.PositiveIntegerField(null=True, blank=True, help_text="Empty: no limit until it expires.")
    uses = models.PositiveIntegerField(default=0, editable=False)
    revoked_at = models.DateTimeField(null=True, blank=True, editable=False)
    created_at = models.DateTimeField(editable=False)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+", editable=False
    )

    class Meta:
        ordering = ["-created_at", "-id"]
        constraints = [
            models.CheckConstraint(
                condition=Q(max_uses__isnull=True) | Q(uses__lte=models.F("max_uses")),
                name="agents_join_token_uses_within_limit",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.name} ({self.prefix}…)"


class NodeCredential(models.Model):
    """A node's own secret: it authorises requests about that node and no other.

    Only the SHA-256 of a 256-bit random token is stored, so a heartbeat's
    authentication is one indexed lookup, and a copy of the database does not
    let anyone impersonate a node. A rotated credential keeps the previous hash
    valid until the new one is first used, so an answer lost on the way does
    not lock the agent out.
    """

    node = models.OneToOneField("inventory.Node", primary_key=True, on_delete=models.CASCADE, related_name="credential")
    token_hash = models.CharField(max_length=64, unique=True)
    previous_hash = models.CharField(max_length=64, unique=True, null=True, blank=True)
    issued_at = models.DateTimeField()
    # How the current secret came to be: the join token's name, or "rotation".
    issued_by = models.CharField(max_length=150, blank=True)
    # An operator asked the agent to rotate; its next heartbeat answer says so.
    rotation_requested_at = models.DateTimeField(null=True, blank=True)
    # SHA-256 of the join nonce of the registration that issued it, while that join
    # may still be retried (agents/credentials.py rejoin).
    join_nonce_hash = models.CharField(max_length=64, blank=True)

    class Meta:
        ordering = ["node_id"]
        constraints = [
            models.CheckConstraint(
                condition=Q(previous_hash__isnull=True) | ~Q(previous_hash=models.F("token_hash")),
                name="agents_credential_previous_differs",
            ),
        ]

    def __str__(self) -> str:
        return f"credential of {self.node_id}"
