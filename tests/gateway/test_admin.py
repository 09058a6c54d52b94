"""API keys in the admin: the secret shown once, revoking, usage per model."""

from __future__ import annotations

import asyncio
import datetime as dt
import html
import re

import pytest
import redis.asyncio as aioredis
from django.conf import settings
from django.contrib.messages import get_messages
from django.utils import timezone

from gateway import figures, keys, usage
from gateway.models import ApiKey, KeyEvent
from placement.models import Deployment, EngineProfile, Replica

pytestmark = pytest.mark.django_db


def test_operator_creates_a_key_shown_once(client, operator):
    client.force_login(operator)
    resp = client.post(
        "/admin/gateway/apikey/add/",
        {
            "name": "team-a",
            "owner": operator.pk,
            "allowed_models": "llama-70b, demo",
            "rpm_limit": 60,
            "tpm_limit": 0,
            "events-TOTAL_FORMS": 0,
            "events-INITIAL_FORMS": 0,
        },
        follow=True,
    )
    assert resp.status_code == 200, resp.content
    shown = [str(m) for m in get_messages(resp.wsgi_request)]
    secret = next(m.split(": ")[-1] for m in shown if "not shown again" in m)
    key = ApiKey.objects.get(name="team-a")
    assert key.key_hash == keys.hash_secret(secret)
    assert key.allowed_models == ["demo", "llama-70b"]
    assert key.created_by == operator
    page = client.get(f"/admin/gateway/apikey/{key.pk}/change/").content.decode()
    assert secret not in page
    assert key.prefix in page


def test_expiry_in_the_past_is_refused_naming_the_field(client, operator):
    client.force_login(operator)
    resp = client.post(
        "/admin/gateway/apikey/add/",
        {
            "name": "x",
            "owner": operator.pk,
            "rpm_limit": 0,
            "tpm_limit": 0,
            "expires_at_0": "2000-01-01",
            "expires_at_1": "00:00:00",
            "events-TOTAL_FORMS": 0,
            "events-INITIAL_FORMS": 0,
        },
    )
    assert resp.status_code == 200
    assert resp.context["adminform"].form.errors == {"expires_at": ["must be in the future"]}
    assert not ApiKey.objects.exists()


def test_revoke_action_and_usage_on_the_key_page(client, operator, now):
    key, _ = keys.create_key(name="k", owner=operator, now=now)
    acc = usage.Accumulator()
    t = now.timestamp()
    acc.add(key.id, "demo", t, prompt_tokens=3, completion_tokens=4)
    acc.add(key.id, "demo", t + 60, prompt_tokens=1, completion_tokens=1, error=True)
    usage.write_batch(acc.take())
    client.force_login(operator)
    page = client.get(f"/admin/gateway/apikey/{key.pk}/change/").content.decode()
    assert "demo: 2 requests, 4 prompt + 5 completion tokens, 1 errors" in page
    assert client.get("/admin/gateway/usageminute/").status_code == 200
    client.post("/admin/gateway/apikey/", {"action": "revoke", "_selected_action": [key.pk]}, follow=True)
    key.refresh_from_db()
    assert key.revoked_at is not None
    assert KeyEvent.objects.filter(key=key, kind="revoked", actor=operator).count() == 1


def test_viewer_cannot_revoke(client, viewer, operator, now):
    key, _ = keys.create_key(name="k", owner=operator, now=now, expires_at=now + dt.timedelta(days=1))
    client.force_login(viewer)
    client.post("/admin/gateway/apikey/", {"action": "revoke", "_selected_action": [key.pk]})
    key.refresh_from_db()
    assert key.revoked_at is None


def test_replicas_at_the_gateway_show_engine_figures_and_ejections(client, operator, now):
    prof = EngineProfile.objects.create(name="p", engine="vllm")
    dep = Deployment.objects.create(name="llama", served_model="llama", profile=prof, replicas=2)
    a = Replica.objects.create(deployment=dep, state="ready", endpoint="http://a:1", created_at=now, updated_at=now)
    b = Replica.objects.create(deployment=dep, state="ready", endpoint="http://b:1", created_at=now, updated_at=now)

    async def share():
        r = aioredis.Redis.from_url(settings.REDIS_URL)
        await figures.publish_async(
            r,
            {
                str(a.id): figures.Figures(7, 2, 0.4375, 0.75, 3, 0.0, 0),
                str(b.id): figures.Figures(None, None, None, None, 0, 25.0, 4),
            },
        )
        await r.aclose()

    asyncio.run(share())
    client.force_login(operator)
    page = client.get("/admin/gateway/routedreplica/").content.decode()
    assert "44%" in page and "75%" in page
    assert "for 25 s more" in page
    assert "http://a:1" in page and "http://b:1" in page


def test_replicas_at_the_gateway_without_redis_read_the_embedded_defaults_cache(client, operator, now, settings):
    settings.REDIS_URL = ""
    prof = EngineProfile.objects.create(name="p", engine="vllm")
    dep = Deployment.objects.create(name="llama", served_model="llama", profile=prof, replicas=1)
    a = Replica.objects.create(deployment=dep, state="ready", endpoint="http://a:1", created_at=now, updated_at=now)
    client.force_login(operator)
    # No gateway has shared anything yet: the page says why its columns are empty.
    page = client.get("/admin/gateway/routedreplica/").content.decode()
    assert html.escape(figures.NONE_SHARED) in page
    figures.publish_cache({str(a.id): figures.Figures(7, 2, 0.4375, 0.75, 3, 0.0, 0)})
    page = client.get("/admin/gateway/routedreplica/").content.decode()
    assert html.escape(figures.NONE_SHARED) not in page
    assert "44%" in page and "75%" in page
    assert '<td class="field-show">7</td>' in page


def test_key_page_shows_budgets_spend_and_the_daily_chart(client, operator):
    now = timezone.now()
    key, _ = keys.create_key(
        name="k", owner=operator, now=now - dt.timedelta(days=60), tokens_per_day=40, tokens_per_month=1000
    )
    acc = usage.Accumulator()
    t = usage.day_start(now).timestamp() + 60  # 00:01 today
    acc.add(key.id, "demo", t, prompt_tokens=30, completion_tokens=10)  # today: 40, the day's budget spent
    acc.add(key.id, "demo", t - 86400, prompt_tokens=20)  # yesterday: 20
    acc.add(key.id, "other", t - 86400, completion_tokens=5)  # yesterday: 25 in all
    acc.add(key.id, "demo", t - 29 * 86400, prompt_tokens=4)  # the chart's first day
    acc.add(key.id, "demo", t - 30 * 86400, prompt_tokens=999)  # before the chart
    usage.write_batch(acc.take())
    client.force_login(operator)
    page = client.get(f"/admin/gateway/apikey/{key.pk}/change/").content.decode()
    month_spent = 40 + sum(
        n
        for day, n in ((1, 25), (29, 4), (30, 999))
        if (usage.day_start(now) - dt.timedelta(days=day)) >= usage.month_start(now)
    )
    assert '<tr data-period="day" data-budget="40" data-spent="40">' in page
    assert f'<tr data-period="month" data-budget="1000" data-spent="{month_spent}">' in page
    assert "spent: requests are refused until the reset" in page
    bars = re.findall(r'<rect class="usage-bar" data-day="([\d-]+)" data-tokens="(\d+)" [^>]*height="([\d.]+)"', page)
    today = usage.day_start(now).date()
    assert len(bars) == 30
    assert bars[0][:2] == ((today - dt.timedelta(days=29)).isoformat(), "4")
    assert bars[-2][:2] == ((today - dt.timedelta(days=1)).isoformat(), "25")
    assert bars[-1] == (today.isoformat(), "40", "120.0")  # the busiest day fills the height
    assert bars[-2][2] == "75.0"
    assert sum(int(b[1]) for b in bars) == 69
    assert f"<title>{today.isoformat()}: 40 tokens</title>" in page
    assert "69 in all; busiest day 40" in page
    assert "<script" not in page.split('id="usage-chart"')[1].split("</svg>")[0]


def test_a_day_budget_above_the_month_is_refused_naming_the_field(client, operator):
    client.force_login(operator)
    resp = client.post(
        "/admin/gateway/apikey/add/",
        {
            "name": "x",
            "owner": operator.pk,
            "rpm_limit": 0,
            "tpm_limit": 0,
            "tokens_per_day": 11,
            "tokens_per_month": 10,
            "events-TOTAL_FORMS": 0,
            "events-INITIAL_FORMS": 0,
        },
    )
    assert resp.status_code == 200
    assert resp.context["adminform"].form.errors == {
        "tokens_per_day": ["more than the month's budget (10): the month would refuse first"]
    }
    assert not ApiKey.objects.exists()


def test_a_change_in_the_admin_is_recorded_old_to_new(client, operator, django_user_model, now):
    bob = django_user_model.objects.create_user("bob")
    key, _ = keys.create_key(name="k", owner=operator, now=now, allowed_models=["demo"])
    client.force_login(operator)
    resp = client.post(
        f"/admin/gateway/apikey/{key.pk}/change/",
        {
            "name": "k",
            "owner": bob.pk,
            "allowed_models": "demo",
            "rpm_limit": 60,
            "tpm_limit": 0,
            "tokens_per_day": 100,
            "tokens_per_month": "",
            "events-TOTAL_FORMS": 1,
            "events-INITIAL_FORMS": 1,
            "events-0-id": KeyEvent.objects.get(key=key).pk,
            "events-0-key": key.pk,
        },
    )
    assert resp.status_code == 302, resp.context["adminform"].form.errors if resp.context else resp
    key.refresh_from_db()
    assert (key.owner, key.rpm_limit, key.tokens_per_day, key.tokens_per_month) == (bob, 60, 100, 0)
    ev = KeyEvent.objects.filter(key=key).first()
    assert (ev.kind, ev.actor_name) == ("changed", "operator")
    assert ev.detail == "owner: operator -> bob; rpm_limit: 0 -> 60; tokens_per_day: 0 -> 100"
