"""The gateway's API shapes: input validators (*In) apart from output serializers (*Out).

Every bound an input enforces is the column's (a limit a PositiveIntegerField
holds, a budget a bigint holds, a name its length) or a constraint's (a day's
budget within the month's), so a value the database would refuse is a 400
naming its field instead of a 500.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from django.contrib.auth import get_user_model
from django.utils import timezone
from rest_framework import serializers

from gateway import usage
from gateway.models import ApiKey
from llmgw.schema import field_errors

# PositiveIntegerField's range (rpm, tpm) and PositiveBigIntegerField's (budgets).
MAX_LIMIT = 2**31 - 1
MAX_BUDGET = 2**63 - 1
MAX_MODELS = 256
MODEL_NAME_MAX = 128
# How far back one usage answer may reach, per bucket: a bound on its rows.
MAX_RANGE = {"minute": dt.timedelta(days=7), "hour": dt.timedelta(days=93), None: dt.timedelta(days=3660)}
MAX_RANGE["day"] = MAX_RANGE[None]


def check_budgets(day: int, month: int) -> None:
    """Refuse a day's budget above the month's (both set): the month would always refuse first."""
    if day and month and day > month:
        raise serializers.ValidationError(
            {"tokens_per_day": [f"{day} is more than tokens_per_month ({month}); the month would refuse first"]}
        )


class KeyOut(serializers.ModelSerializer):
    """A key as read: never its secret; with the tokens it has spent this UTC day and month (as recorded)."""

    owner = serializers.CharField(source="owner.username", read_only=True)
    created_by = serializers.CharField(source="created_by.username", read_only=True, allow_null=True)
    spent_today = serializers.SerializerMethodField()
    spent_this_month = serializers.SerializerMethodField()

    class Meta:
        model = ApiKey
        fields = [
            "id",
            "name",
            "prefix",
            "owner",
            "allowed_models",
            "rpm_limit",
            "tpm_limit",
            "tokens_per_day",
            "tokens_per_month",
            "spent_today",
            "spent_this_month",
            "expires_at",
            "revoked_at",
            "created_at",
            "created_by",
        ]

    def _spent(self, obj: ApiKey) -> usage.Spent:
        # The view reads a page's spend in one query and passes it in; a lone key reads its own.
        known = self.context.get("spent")
        if known is None:
            known = usage.spent([obj.id], timezone.now())
        return known.get(obj.id, usage.Spent())

    def get_spent_today(self, obj: ApiKey) -> int:
        """Tokens recorded for this key since 00:00 UTC today."""
        return self._spent(obj).day

    def get_spent_this_month(self, obj: ApiKey) -> int:
        """Tokens recorded for this key since the first of this month, 00:00 UTC."""
        return self._spent(obj).month


class KeyCreatedOut(KeyOut):
    """A key just created or rotated, with its secret: shown this once, kept nowhere."""

    secret = serializers.CharField(read_only=True)

    class Meta(KeyOut.Meta):
        fields = [*KeyOut.Meta.fields, "secret"]


def _models_field(**kwargs: Any) -> serializers.ListField:
    return serializers.ListField(
        child=serializers.CharField(max_length=MODEL_NAME_MAX), max_length=MAX_MODELS, **kwargs
    )


class KeyUpdateIn(serializers.Serializer):
    """A key's changeable fields (owner: a username); each optional. allowed_models empty: every model; 0: none."""

    name = serializers.CharField(max_length=128, required=False)
    owner = serializers.SlugRelatedField(slug_field="username", queryset=get_user_model().objects.all(), required=False)
    allowed_models = _models_field(required=False)
    rpm_limit = serializers.IntegerField(min_value=0, max_value=MAX_LIMIT, required=False)
    tpm_limit = serializers.IntegerField(min_value=0, max_value=MAX_LIMIT, required=False)
    tokens_per_day = serializers.IntegerField(min_value=0, max_value=MAX_BUDGET, required=False)
    tokens_per_month = serializers.IntegerField(min_value=0, max_value=MAX_BUDGET, required=False)
    expires_at = serializers.DateTimeField(allow_null=True, required=False)

    def validate_expires_at(self, value: dt.datetime | None) -> dt.datetime | None:
        """An expiry must lie ahead (null: never expires)."""
        if value is not None and value <= timezone.now():
            raise serializers.ValidationError("must be in the future")
        return value

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        """The day's budget within the month's, counting the key's current values for what is not sent."""
        key = self.instance
        day = attrs.get("tokens_per_day", key.tokens_per_day if key else 0)
        month = attrs.get("tokens_per_month", key.tokens_per_month if key else 0)
        check_budgets(day, month)
        return attrs


class KeyIn(KeyUpdateIn):
    """A new key: its name and owner (a username) required, the rest as in a change."""

    name = serializers.CharField(max_length=128)
    owner = serializers.SlugRelatedField(slug_field="username", queryset=get_user_model().objects.all())
    allowed_models = _models_field(default=list)
    rpm_limit = serializers.IntegerField(min_value=0, max_value=MAX_LIMIT, default=0)
    tpm_limit = serializers.IntegerField(min_value=0, max_value=MAX_LIMIT, default=0)
    tokens_per_day = serializers.IntegerField(min_value=0, max_value=MAX_BUDGET, default=0)
    tokens_per_month = serializers.IntegerField(min_value=0, max_value=MAX_BUDGET, default=0)
    expires_at = serializers.DateTimeField(allow_null=True, default=None)


KeyInErrors = field_errors(
    "KeyInErrors",
    "400 from a key's create or change: each field named with its problems (only those with one appear).",
    ("name", "owner", "allowed_models", "rpm_limit", "tpm_limit", "tokens_per_day", "tokens_per_month", "expires_at"),
    allowed_models=serializers.JSONField(required=False),
)


class KeyConflictOut(serializers.Serializer):
    """409: the key's state does not allow the action (it is revoked)."""

    detail = serializers.CharField(read_only=True)


class UsageIn(serializers.Serializer):
    """The usage report's query: a time range, what to group by, the bucket, and optional filters."""

    start = serializers.DateTimeField(required=False, help_text="inclusive; default: 24 hours before `end`")
    end = serializers.DateTimeField(required=False, help_text="exclusive; default: now")
    group_by = serializers.CharField(
        required=False, default="key,model", help_text="`key`, `model` or both, separated by a comma"
    )
    bucket = serializers.ChoiceField(
        choices=usage.BUCKETS, required=False, help_text="default: one row per group for the whole range"
    )
    key = serializers.IntegerField(required=False, min_value=1, max_value=2**63 - 1, help_text="one key's id")
    model = serializers.CharField(required=False, max_length=MODEL_NAME_MAX)

    def validate_group_by(self, value: str) -> list[str]:
        """A list of known groups, each once."""
        parts = [p.strip() for p in value.split(",") if p.strip()]
        bad = [p for p in parts if p not in usage.GROUPS]
        if bad or not parts:
            raise serializers.ValidationError(f"must be key, model or key,model; got {value!r}")
        return list(dict.fromkeys(parts))

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        """Defaults for the range; start before end, and no longer than the bucket allows."""
        end = attrs.get("end") or timezone.now()
        start = attrs.get("start") or end - dt.timedelta(hours=24)
        if start >= end:
            raise serializers.ValidationError({"start": ["must be before end"]})
        bucket = attrs.get("bucket")
        if end - start > MAX_RANGE[bucket]:
            days = MAX_RANGE[bucket].days
            raise serializers.ValidationError(
                {"start": [f"the range may span at most {days} days with bucket={bucket or 'none'}"]}
            )
        attrs["start"], attrs["end"] = start, end
        return attrs


UsageInErrors = field_errors(
    "UsageInErrors",
    "400 from the usage report: each query parameter named with its problems (only those with one appear).",
    ("start", "end", "group_by", "bucket", "key", "model"),
)


class UsageRowOut(serializers.Serializer):
    """One group's usage: the bucket's start (null: the whole range), the key and model asked for, the sums."""

    bucket = serializers.DateTimeField(allow_null=True, read_only=True)
    key_id = serializers.IntegerField(required=False, read_only=True)
    key_name = serializers.CharField(required=False, read_only=True)
    model = serializers.CharField(required=False, read_only=True)
    requests = serializers.IntegerField(read_only=True)
    prompt_tokens = serializers.IntegerField(read_only=True)
    completion_tokens = serializers.IntegerField(read_only=True)
    total_tokens = serializers.IntegerField(read_only=True)
    errors = serializers.IntegerField(read_only=True)


class UsageOut(serializers.Serializer):
    """The usage report: the range and grouping it answers, and its rows."""

    start = serializers.DateTimeField(read_only=True)
    end = serializers.DateTimeField(read_only=True)
    group_by = serializers.ListField(child=serializers.CharField(), read_only=True)
    bucket = serializers.CharField(allow_null=True, read_only=True)
    rows = UsageRowOut(many=True, read_only=True)
