"""API keys for the gateway and the events that change them.

Only a key's hash is stored: the secret is shown once, when it is created.
The data plane holds the hashes in memory and never reads these rows per
request; a change is pushed to it (gateway/notify.py).
"""

from __future__ import annotations

import datetime as dt

from django.conf import settings
from django.db import models
from django.db.models import Q

from placement.models import Replica


class ApiKey(models.Model):
    """A client's key: who owns it, until when, which models it may use, and its limits."""

    name = models.CharField(max_length=128)
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="gateway_keys")
    # The first characters of the secret, to recognise a key in a list; never enough to use it.
    prefix = models.CharField(max_length=24, editable=False)
    key_hash = models.CharField(max_length=64, unique=True, editable=False)
    # Empty: every served model.
    allowed_models = models.JSONField(default=list, blank=True)
    # 0: no limit. Enforced across every gateway process through Redis.
    rpm_limit = models.PositiveIntegerField("requests a minute", default=0)
    tpm_limit = models.PositiveIntegerField("tokens a minute", default=0)
    # Budgets in tokens (prompt + completion) per UTC day and UTC month; 0: none. Enforced by
    # the data planes from counters in Redis (gateway/dataplane/budgets.py), checked against
    # the recorded usage.
    tokens_per_day = models.PositiveBigIntegerField("tokens a day (UTC)", default=0)
    tokens_per_month = models.PositiveBigIntegerField("tokens a month (UTC)", default=0)
    expires_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField()
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )

    class Meta:
        ordering = ["name", "id"]
        verbose_name = "API key"
        constraints = [
            models.CheckConstraint(
                condition=Q(expires_at__isnull=True) | Q(expires_at__gt=models.F("created_at")),
                name="gateway_apikey_expires_after_created",
            ),
            models.CheckConstraint(
                condition=Q(tokens_per_day__gte=0) & Q(tokens_per_month__gte=0),
                name="gateway_apikey_budgets_not_negative",
            ),
            # A day's budget above the month's could never be spent: the month refuses first.
            models.CheckConstraint(
                condition=Q(tokens_per_day=0)
                | Q(tokens_per_month=0)
                | Q(tokens_per_day__lte=models.F("tokens_per_month")),
                name="gateway_apikey_day_budget_within_month",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.name} ({self.prefix}…)"

    def usable(self, now: dt.datetime) -> bool:
        """Whether the key opens the gateway at `now`: not revoked, not expired."""
        return self.revoked_at is None and (self.expires_at is None or self.expires_at > now)


class KeyEvent(models.Model):
    """An operator's action on a key (created, changed, rotated, revoked), with who and when."""

    at = models.DateTimeField(db_index=True)
    key = models.ForeignKey(ApiKey, on_delete=models.CASCADE, related_name="events")
    kind = models.CharField(max_length=32)
    detail = models.TextField(blank=True)
    actor = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    actor_name = models.CharField(max_length=150, blank=True)

    class Meta:
        ordering = ["-at", "-id"]

    def __str__(self) -> str:
        return f"{self.at:%Y-%m-%d %H:%M:%S} {self.kind} {self.key_id}: {self.detail}"


class UsageMinute(models.Model):
    """One key's use of one model in one minute, summed over every gateway process.

    Written in batches by the data planes (an upsert adding to the row), never
    a row per request.
    """

    key = models.ForeignKey(ApiKey, on_delete=models.CASCADE, related_name="usage")
    model = models.CharField(max_length=128)
    minute = models.DateTimeField()
    requests = models.PositiveBigIntegerField(default=0)
    prompt_tokens = models.PositiveBigIntegerField(default=0)
    completion_tokens = models.PositiveBigIntegerField(default=0)
    errors = models.PositiveBigIntegerField(default=0)
    # Time to first token, summed over the requests that had one, for the mean.
    ttft_seconds_sum = models.FloatField(default=0.0)
    ttft_count = models.PositiveBigIntegerField(default=0)

    class Meta:
        ordering = ["-minute", "key_id", "model"]
        constraints = [
            models.UniqueConstraint(fields=["key", "model", "minute"], name="gateway_usage_key_model_minute_unique"),
        ]

    def __str__(self) -> str:
        return f"{self.key_id} {self.model} {self.minute:%Y-%m-%d %H:%M}"

    @property
    def mean_ttft_ms(self) -> float | None:
        """Mean time to first token in milliseconds, None when no request had one."""
        return self.ttft_seconds_sum * 1000 / self.ttft_count if self.ttft_count else None


class RoutedReplica(Replica):
    """A replica as the gateway sees it (its own admin page: engine figures, in-flight, ejections)."""

    class Meta:
        proxy = True
        verbose_name = "replica at the gateway"
        verbose_name_plural = "replicas at the gateway"
