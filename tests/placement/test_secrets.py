"""Secrets in profiles are write-only: API, admin, events and queued commands show the mask, never the value."""

from __future__ import annotations

import pytest
from django.test import Client
from rest_framework.test import APIClient

from inventory.models import Command
from placement import secrets
from placement.models import Deployment, EngineProfile, PlacementEvent
from placement.reconciler import reconcile
from tests.factories import make_node

pytestmark = pytest.mark.django_db

ENV = {"HF_TOKEN": "hf_live_123", "OPENAI_API_KEY": "sk-9", "HF_HOME": "/models", "MAX_TOKENS": "8"}
ARGS = ["--api-key", "key-1", "--hf-token=hf_2", "--max-num-batched-tokens", "8192"]
SECRETS = ("hf_live_123", "sk-9", "key-1", "hf_2")


def api(user) -> APIClient:
    c = APIClient()
    c.force_authenticate(user)
    return c


def no_secret_in(text: str | bytes) -> None:
    raw = text.decode() if isinstance(text, bytes) else text
    for s in SECRETS:
        assert s not in raw


def test_kept_env_and_args():
    assert secrets.kept_env({"HF_TOKEN": "***", "A": "b"}, {"HF_TOKEN": "old"}) == {"HF_TOKEN": "old", "A": "b"}
    assert secrets.kept_env({"HF_TOKEN": "new"}, {"HF_TOKEN": "old"}) == {"HF_TOKEN": "new"}
    with pytest.raises(secrets.HiddenWithoutValue, match="HF_TOKEN is \\*\\*\\* but has no stored value"):
        secrets.kept_env({"HF_TOKEN": "***"}, {})
    stored = ["--api-key", "k1", "--hf-token=h1", "--api-key", "k2"]
    assert secrets.kept_args(["--api-key", "***", "--hf-token=***", "--api-key", "***"], stored) == stored
    assert secrets.kept_args(["--api-key", "new", "--api-key", "***"], stored) == [
        "--api-key",
        "new",
        "--api-key",
        "k2",
    ]
    with pytest.raises(secrets.HiddenWithoutValue, match="--db-password's value"):
        secrets.kept_args(["--db-password=***"], stored)


def test_the_api_never_shows_a_secret_and_keeps_it_when_sent_back_masked(operator, viewer):
    r = api(operator).post(
        "/api/v1/profiles/", {"name": "p", "engine": "vllm", "env": ENV, "args": ARGS}, format="json"
    )
    assert r.status_code == 201
    no_secret_in(r.content)
    shown = api(viewer).get(f"/api/v1/profiles/{r.json()['id']}/").json()
    assert shown["env"] == {"HF_TOKEN": "***", "OPENAI_API_KEY": "***", "HF_HOME": "/models", "MAX_TOKENS": "8"}
    assert shown["args"] == ["--api-key", "***", "--hf-token=***", "--max-num-batched-tokens", "8192"]
    # Written back as read, with one ordinary change: the secrets stay.
    back = {**shown, "env": {**shown["env"], "HF_HOME": "/data"}}
    assert api(operator).put(f"/api/v1/profiles/{shown['id']}/", back, format="json").status_code == 200
    p = EngineProfile.objects.get()
    assert p.env == {**ENV, "HF_HOME": "/data"} and p.args == ARGS
    # Replaced by a new value.
    r = api(operator).patch(f"/api/v1/profiles/{p.id}/", {"env": {**back["env"], "HF_TOKEN": "hf_new"}}, format="json")
    assert r.status_code == 200
    assert EngineProfile.objects.get().env["HF_TOKEN"] == "hf_new"
    for ev in PlacementEvent.objects.all():
        no_secret_in(ev.reason)
        assert "hf_new" not in ev.reason
    reasons = sorted(PlacementEvent.objects.values_list("reason", flat=True))
    assert reasons == [
        "changed: profile p: env {'HF_HOME': '/models', 'HF_TOKEN': '***', 'MAX_TOKENS': '8', 'OPENAI_API_KEY': '***'}"
        " -> {'HF_HOME': '/data', 'HF_TOKEN': '***', 'MAX_TOKENS': '8', 'OPENAI_API_KEY': '***'}",
        "changed: profile p: env: a secret value replaced",
        "created: profile p",
    ]


def test_a_masked_secret_without_a_stored_value_is_400(operator):
    r = api(operator).post(
        "/api/v1/profiles/", {"name": "p", "engine": "vllm", "env": {"HF_TOKEN": "***"}}, format="json"
    )
    assert r.status_code == 400
    assert r.json() == {"env": ["HF_TOKEN is *** but has no stored value to keep: send its value"]}


def test_the_admin_shows_the_mask_and_keeps_the_secret(admin_user):
    p = EngineProfile.objects.create(name="p", engine="vllm", env=ENV, args=ARGS)
    c = Client()
    c.force_login(admin_user)
    page = c.get(f"/admin/placement/engineprofile/{p.id}/change/")
    assert page.status_code == 200
    no_secret_in(page.content)
    form = {
        "name": "p", "engine": "vllm", "engine_version": "", "gpu_class": "", "tp": "1", "pp": "1",
        "gpus_per_node": "0", "nodes": "1", "memory_gb": "0", "cpu_cores": "0", "power_w": "0",
        "args": page.context["adminform"].form["args"].value(), "env": page.context["adminform"].form["env"].value(),
        "model_path": "/m", "disk_gb": "0", "served_model_name": "", "startup_timeout_s": "1800",
    }  # fmt: skip
    resp = c.post(f"/admin/placement/engineprofile/{p.id}/change/", form)
    assert resp.status_code == 302
    p.refresh_from_db()
    assert (p.env, p.args, p.model_path) == (ENV, ARGS, "/m")


def test_queued_start_shards_carry_the_secret_but_the_admin_shows_the_mask(admin_user, now):
    profile = EngineProfile.objects.create(name="p", engine="echo", gpus_per_node=1, env=ENV, args=ARGS)
    Deployment.objects.create(name="d", served_model="m", profile=profile, replicas=1)
    make_node("a", now=now)
    reconcile(now=now)
    cmd = Command.objects.get(kind="start_shard")
    assert cmd.payload["profile"]["env"]["HF_TOKEN"] == "hf_live_123"
    c = Client()
    c.force_login(admin_user)
    page = c.get(f"/admin/inventory/command/{cmd.id}/change/")
    assert page.status_code == 200
    no_secret_in(page.content)
    assert b"HF_TOKEN" in page.content
