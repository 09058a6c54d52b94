"""End to end: an operator's "Rotate" in the admin, a real agent process trading its credential.

The real control plane (live_server) and a real agent process in fixture
mode running its whole loop: the admin action sets the flag, the next
heartbeat's answer carries it, the agent calls the rotate endpoint, stores the
new credential and heartbeats with it, and from then on the old one is refused.
"""

from __future__ import annotations

import datetime as dt
import json
import stat
import time

import httpx
import pytest

from agents import credentials
from agents.models import NodeCredential
from inventory.models import NodeEvent
from llmgw_sim.simulate import Fleet
from tests.llmgw_agent.helpers import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def _heartbeat(url: str, token: str, node_id: str) -> httpx.Response:
    body = {"node_id": node_id, "at": time.time()}
    return httpx.post(
        f"{url}/api/v1/agent/heartbeat",
        content=json.dumps(body),
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
        timeout=10,
    )


def test_admin_rotate_makes_the_agent_trade_its_credential(live_server, tmp_path, client, operator, settings):
    settings.LLMGW_HEARTBEAT_INTERVAL = 0.2
    now = dt.datetime.now(dt.UTC)
    _, join = credentials.create_join_token(name="e2e", expires_at=now + dt.timedelta(hours=1), max_uses=1, now=now)
    fleet = Fleet(
        nodes=1,
        control_plane=live_server.url,
        join_token=join,
        workdir=tmp_path / "fleet",
        profiles=["cpu-only"],
        heartbeat_interval=0.2,
    )
    node = fleet.nodes[0]
    cred_file = node.dir / "state" / "credential"
    fleet.start()
    try:
        wait_for(
            lambda: cred_file.exists() and NodeCredential.objects.filter(node_id=node.node_id).exists(), timeout=30
        )
        old = cred_file.read_text()
        assert NodeCredential.objects.get(node_id=node.node_id).token_hash == credentials.hash_secret(old)

        client.force_login(operator)
        resp = client.post(
            "/admin/agents/nodecredential/",
            {"action": "request_rotation", "_selected_action": [node.node_id]},
            follow=True,
        )
        assert resp.status_code == 200

        # Rotated, and the new credential already used: the control plane forgot the old one.
        def rotated_and_used():
            c = NodeCredential.objects.get(node_id=node.node_id)
            return c.issued_by == "rotation" and c.previous_hash is None and c.rotation_requested_at is None

        wait_for(rotated_and_used, timeout=30)
        new = cred_file.read_text()
        assert new != old and new.startswith(credentials.NODE_PREFIX)
        assert NodeCredential.objects.get(node_id=node.node_id).token_hash == credentials.hash_secret(new)
        assert stat.S_IMODE(cred_file.stat().st_mode) == 0o600
        assert sorted(p.name for p in cred_file.parent.iterdir() if "credential" in p.name) == ["credential"]
        assert node.proc.poll() is None, "the agent kept running"

        assert _heartbeat(live_server.url, old, node.node_id).status_code == 401
        assert _heartbeat(live_server.url, new, node.node_id).status_code == 200
    finally:
        fleet.stop(grace_s=5)

    log = (node.dir / "agent.log").read_text()
    assert "credential rotated" in log
    assert old not in log and new not in log
    assert list(
        NodeEvent.objects.filter(node_id=node.node_id, kind="credential").order_by("id").values_list("message", "actor")
    ) == [
        ("credential issued (e2e)", None),
        ("credential rotation requested", operator.id),
        ("credential rotated", None),
    ]
