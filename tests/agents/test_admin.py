"""Join tokens and node credentials in the admin: create once-shown tokens, reset, ask for rotation."""

from __future__ import annotations

import pytest
from django.contrib.messages import get_messages

from agents import credentials
from agents.models import JoinToken, NodeCredential
from inventory.models import NodeEvent
from tests.agents.conftest import heartbeat_payload, post
from tests.factories import register_payload

pytestmark = pytest.mark.django_db


def test_operator_creates_a_join_token_shown_once(client, operator):
    client.force_login(operator)
    resp = client.post(
        "/admin/agents/jointoken/add/", {"name": "rack 7", "valid_for_hours": 2, "max_uses": 3}, follow=True
    )
    assert resp.status_code == 200
    text = [str(m) for m in get_messages(resp.wsgi_request)]
    secret = next(t.split(": ")[-1] for t in text if "Join token created" in t)
    token = JoinToken.objects.get()
    assert (token.name, token.max_uses, token.uses, token.created_by) == ("rack 7", 3, 0, operator)
    assert token.token_hash == credentials.hash_secret(secret) and secret.startswith(token.prefix)
    assert post(client, "register", register_payload("node-a"), secret).status_code == 200
    token.refresh_from_db()
    assert token.uses == 1


def test_reset_and_rotation_actions(client, operator, joined):
    client.force_login(operator)
    url = "/admin/agents/nodecredential/"
    resp = client.post(url, {"action": "request_rotation", "_selected_action": ["node-a"]}, follow=True)
    assert resp.status_code == 200
    assert NodeCredential.objects.get(node_id="node-a").rotation_requested_at is not None
    assert post(client, "heartbeat", heartbeat_payload(), joined).json()["rotate_credential"] is True
    client.post(url, {"action": "reset", "_selected_action": ["node-a"]}, follow=True)
    assert not NodeCredential.objects.exists()
    assert post(client, "heartbeat", heartbeat_payload(), joined).status_code == 401
    ev = NodeEvent.objects.filter(kind="credential").first()
    assert (ev.message, ev.actor) == ("credential reset: the node must join again", operator)


def test_viewer_cannot_reset(client, viewer, joined):
    viewer.is_staff = True
    viewer.save()
    client.force_login(viewer)
    client.post("/admin/agents/nodecredential/", {"action": "reset", "_selected_action": ["node-a"]})
    assert NodeCredential.objects.filter(node_id="node-a").exists()
    assert client.get("/admin/agents/jointoken/add/").status_code == 403
