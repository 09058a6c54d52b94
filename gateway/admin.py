"""API keys and their usage in the admin.

A key's secret is shown once, on the page after it is created; only its hash
is kept. Revoking is an action (every data plane drops the key within a
second). Usage is listed per key and model per minute, and summed per key
and per model on the key's page, with its budgets, this day's and month's
spend, and its tokens per day for the last 30 days as an inline SVG chart
(templates/admin/gateway/apikey/change_form.html).
"""

from __future__ import annotations

import datetime as dt

from django import forms
from django.contrib import admin, messages
from django.db.models import Sum
from django.utils import timezone
from django.utils.html import format_html_join

from gateway import figures, keys, usage, usage_chart
from gateway.models import ApiKey, KeyEvent, RoutedReplica, UsageMinute
from llmgw.admin import ReadOnlyAdmin

# The form edits what keys.update may change, no more.
FORM_FIELDS = list(keys.CHANGEABLE)
CHART_DAYS = 30


class ApiKeyForm(forms.ModelForm):
    """A key's owner, name, models and limits; models as a comma-separated list."""

    allowed_models = forms.CharField(
        required=False,
        help_text="Served model names, separated by commas; empty: every model.",
        widget=forms.TextInput(attrs={"size": 80}),
    )

    class Meta:
        model = ApiKey
        fields = FORM_FIELDS

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if self.instance.pk:
            self.initial["allowed_models"] = ", ".join(self.instance.allowed_models or [])
        # Left empty: no budget (0), as a form posted before budgets existed means.
        for name in ("tokens_per_day", "tokens_per_month"):
            self.fields[name].required = False

    def clean_allowed_models(self) -> list[str]:
        """A sorted list of unique names."""
        raw = self.cleaned_data.get("allowed_models") or ""
        return sorted({m.strip() for m in raw.split(",") if m.strip()})

    def clean_expires_at(self):
        """An expiry must lie ahead when the key is created."""
        value = self.cleaned_data.get("expires_at")
        if value is not None and not self.instance.pk and value <= timezone.now():
            raise forms.ValidationError("must be in the future")
        return value

    def clean_tokens_per_day(self) -> int:
        """Empty: no budget."""
        return self.cleaned_data.get("tokens_per_day") or 0

    def clean_tokens_per_month(self) -> int:
        """Empty: no budget."""
        return self.cleaned_data.get("tokens_per_month") or 0

    def clean(self):
        """A day's budget no more than the month's (the database's check, said on the field)."""
        data = super().clean()
        day, month = data.get("tokens_per_day") or 0, data.get("tokens_per_month") or 0
        if day and month and day > month:
            self.add_error("tokens_per_day", f"more than the month's budget ({month}): the month would refuse first")
        return data


class KeyEventInline(admin.TabularInline):
    model = KeyEvent
    extra = 0
    can_delete = False
    fields = ["at", "kind", "detail", "actor_name"]
    readonly_fields = fields

    def has_add_permission(self, request, obj=None) -> bool:
        return False


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin):
    form = ApiKeyForm
    list_display = [
        "name",
        "prefix",
        "owner",
        "models",
        "rpm_limit",
        "tpm_limit",
        "tokens_per_day",
        "tokens_per_month",
        "expires_at",
        "revoked_at",
    ]
    list_filter = ["revoked_at"]
    search_fields = ["name", "prefix", "owner__username"]
    autocomplete_fields = ["owner"]
    readonly_fields = ["prefix", "revoked_at", "created_at", "created_by", "usage_by_model"]
    inlines = [KeyEventInline]
    actions = ["revoke"]

    @admin.display(description="models")
    def models(self, obj: ApiKey) -> str:
        return ", ".join(obj.allowed_models) or "all"

    @admin.display(description="usage by model (all time)")
    def usage_by_model(self, obj: ApiKey) -> str:
        rows = (
            UsageMinute.objects.filter(key=obj)
            .values("model")
            .annotate(
                requests=Sum("requests"),
                prompt=Sum("prompt_tokens"),
                completion=Sum("completion_tokens"),
                errors=Sum("errors"),
            )
            .order_by("model")
        )
        return (
            format_html_join(
                "",
                "<div>{}: {} requests, {} prompt + {} completion tokens, {} errors</div>",
                ((r["model"], r["requests"], r["prompt"], r["completion"], r["errors"]) for r in rows),
            )
            or "none yet"
        )

    def get_fields(self, request, obj=None):
        if obj is None:
            return FORM_FIELDS
        # What may change, the prefix beside the name, then what is only read.
        return [
            *FORM_FIELDS[:1],
            "prefix",
            *FORM_FIELDS[1:],
            "revoked_at",
            "created_at",
            "created_by",
            "usage_by_model",
        ]

    def change_view(self, request, object_id, form_url="", extra_context=None):
        """The key's page, with its budgets, this day's and month's spend, and its tokens per day."""
        extra_context = dict(extra_context or {})
        key = self.get_object(request, object_id)
        if key is not None:
            extra_context.update(budget_page(key, timezone.now()))
        return super().change_view(request, object_id, form_url, extra_context)

    def save_model(self, request, obj, form, change):
        now = timezone.now()
        if change:
            # Through keys.update, which compares with the stored row: the event says old -> new.
            values = {f: form.cleaned_data[f] for f in form.changed_data if f in keys.CHANGEABLE}
            keys.update(obj.id, values, now=now, actor=request.user)
            return
        _, secret = keys.create_key(
            name=obj.name,
            owner=obj.owner,
            allowed_models=form.cleaned_data["allowed_models"],
            rpm_limit=obj.rpm_limit,
            tpm_limit=obj.tpm_limit,
            tokens_per_day=obj.tokens_per_day,
            tokens_per_month=obj.tokens_per_month,
            expires_at=obj.expires_at,
            now=now,
            actor=request.user,
            key=obj,
        )
        self.message_user(
            request, f"API key created. Copy it now, it is not shown again: {secret}", level=messages.WARNING
        )

    @admin.action(description="Revoke the selected API keys", permissions=["change"])
    def revoke(self, request, queryset):
        now = timezone.now()
        n = sum(keys.revoke(k.id, now=now, actor=request.user) for k in queryset)
        self.message_user(request, f"{n} API key(s) revoked.")


def budget_page(key: ApiKey, now: dt.datetime) -> dict:
    """What the key's page shows above its form: each budget with its spend and reset, and the daily chart."""
    spent = usage.spent([key.id], now).get(key.id, usage.Spent())
    today = usage.day_start(now)
    this_month = usage.month_start(now)
    next_month = (this_month + dt.timedelta(days=32)).replace(day=1)
    rows = []
    for period, budget, used, reset in (
        ("day", key.tokens_per_day, spent.day, today + dt.timedelta(days=1)),
        ("month", key.tokens_per_month, spent.month, next_month),
    ):
        percent = round(used * 100 / budget) if budget else None
        rows.append({"period": period, "budget": budget, "spent": used, "percent": percent, "resets_at": reset})
    chart = usage_chart.daily_chart(usage.daily_tokens(key.id, now, CHART_DAYS))
    return {"budgets": rows, "chart": chart}


@admin.register(UsageMinute)
class UsageMinuteAdmin(ReadOnlyAdmin, admin.ModelAdmin):
    list_display = ["minute", "key", "model", "requests", "prompt_tokens", "completion_tokens", "errors", "ttft_ms"]
    list_filter = ["model"]
    search_fields = ["key__name", "model"]
    date_hierarchy = "minute"
    list_select_related = ["key"]

    @admin.display(description="mean TTFT (ms)")
    def ttft_ms(self, obj: UsageMinute) -> str:
        v = obj.mean_ttft_ms
        return "" if v is None else f"{v:.1f}"


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


@admin.register(RoutedReplica)
class RoutedReplicaAdmin(ReadOnlyAdmin, admin.ModelAdmin):
    """Each serving or retiring replica with what the gateways see: engine load and cache, in-flight, ejection.

    The figures are read once per page (from Redis, or the embedded default's
    cache), for the replicas listed; when no gateway shared any, the page says so.
    """

    list_filter = ["state", "deployment"]
    search_fields = ["deployment__name", "deployment__served_model", "endpoint"]
    list_select_related = ["deployment"]

    def get_queryset(self, request):
        return super().get_queryset(request).filter(state__in=["ready", "degraded", "draining"])

    def _figures(self, request) -> dict[str, figures.Figures]:
        if not hasattr(request, "gateway_figures"):
            ids = [str(rid) for rid in self.get_queryset(request).values_list("id", flat=True)]
            request.gateway_figures = figures.read(ids)
            request.gateway_listed = bool(ids)
        return request.gateway_figures

    def changelist_view(self, request, extra_context=None):
        """The list, with a plain word when no gateway shared figures for any listed replica."""
        if not self._figures(request) and request.gateway_listed:
            messages.warning(request, figures.NONE_SHARED)
        return super().changelist_view(request, extra_context)

    def get_list_display(self, request):
        seen = self._figures(request)

        def col(title: str, get):
            def show(obj):
                f = seen.get(str(obj.id))
                return "-" if f is None else get(f)

            show.short_description = title
            return show

        return [
            "__str__",
            "state",
            "endpoint",
            col("running", lambda f: _fmt(f.running, ".0f")),
            col("waiting", lambda f: _fmt(f.waiting, ".0f")),
            col("KV cache used", lambda f: _fmt(f.kv_usage, ".0%")),
            col("prefix cache hits", lambda f: _fmt(f.hit_ratio, ".0%")),
            col("in flight (one gateway)", lambda f: str(f.inflight)),
            col("ejected", lambda f: f"for {f.ejected_for_s:.0f} s more" if f.ejected_for_s else "no"),
            col("failures in a row", lambda f: str(f.failures)),
        ]
