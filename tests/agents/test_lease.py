"""POST /api/v1/agent/lease: one statement when nothing waits, two when commands do.

And the credential rules of every agent endpoint.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import logging

import httpx
import pytest
from django.core.cache import cache
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

import agents.lease
import llmgw_wire as wire
from agents import credentials
from agents.lease import MAX_LEASE_BODY
from agents.models import NodeCredential
from inventory import heartbeat as hb_rules
from inventory import outbox, telemetry
from inventory.models import Command, Node, NodeEvent
from llmgw_agent import config as config_mod
from llmgw_agent.loop import Agent
from tests.agents.conftest import heartbeat_payload, post
from tests.agents.test_api import _closed_port
from tests.factories import register_payload
from tests.llmgw_agent.test_loop import Probe, Sampled

pytestmark = pytest.mark.django_db


def lease(node_id: str = "node-a", **extra) -> dict:
    return {"node_id": node_id, "at": 1_800_000_000.0, **extra}


def renew(client, token: str | None, body=None):
    return post(client, "lease", lease() if body is None else body, token)


@pytest.fixture(autouse=True)
def _every_lease_checks_the_status(monkeypatch):
    # Production asks the cache on about one lease in STATUS_CHECK_EVERY; the tests, on every one.
    monkeypatch.setattr(agents.lease, "STATUS_CHECK_EVERY", 1)


@pytest.fixture
def reporting(client, joined) -> str:
    """node-a joined and sent one full heartbeat (the control plane holds its status)."""
    resp = post(client, "heartbeat", heartbeat_payload(at=1.0, counters=10), joined)
    assert resp.status_code == 200
    assert resp.json()["leases"] is True
    return joined


def test_a_lease_with_nothing_waiting_is_one_statement(client, reporting):
    old = timezone.now() - dt.timedelta(seconds=20)
    Node.objects.filter(id="node-a").update(last_seen=old)
    with CaptureQueriesContext(connection) as q:
        resp = renew(client, reporting)
    assert resp.status_code == 200, resp.content
    assert len(q.captured_queries) == 1, [x["sql"] for x in q.captured_queries]
    assert q.captured_queries[0]["sql"].startswith("UPDATE inventory_node AS n SET last_seen")
    answer = wire.LeaseResponse.model_validate_json(resp.content)
    assert (answer.commands, answer.again, answer.send_status, answer.rotate_credential) == ([], False, False, None)
    assert Node.objects.get(id="node-a").last_seen > old
    # A lease's answer is small, like the lease.
    assert len(resp.content) < 200 and len(wire.Lease(**lease()).model_dump_json()) < 200


def test_a_lease_with_commands_waiting_is_two_statements(client, reporting, now):
    cmd = outbox.enqueue("node-a", wire.InstallEngine(engine="sglang"), now=now)
    with CaptureQueriesContext(connection) as q:
        resp = renew(client, reporting)
    assert len(q.captured_queries) == 2, [x["sql"] for x in q.captured_queries]
    answer = wire.LeaseResponse.model_validate_json(resp.content)
    assert [c.id for c in answer.commands] == [str(cmd.id)]
    assert answer.again is False
    row = Command.objects.get(id=cmd.id)
    assert (row.deliveries, row.first_delivered_at is not None, row.acked_at) == (1, True, None)
    # Delivered until acknowledged.
    assert [c["id"] for c in renew(client, reporting).json()["commands"]] == [str(cmd.id)]
    assert Command.objects.get(id=cmd.id).deliveries == 2


def test_acks_ride_in_the_lease_statement(client, reporting, now):
    done = outbox.enqueue("node-a", wire.InstallEngine(engine="sglang"), now=now)
    with CaptureQueriesContext(connection) as q:
        answer = renew(client, reporting, lease(acks=[str(done.id), "not-a-uuid"])).json()
    assert len(q.captured_queries) == 1
    assert answer["commands"] == [] and Command.objects.get(id=done.id).acked_at is not None
    # An ack and another command waiting: still one renewal, and one fetch.
    again = outbox.enqueue("node-a", wire.InstallEngine(engine="vllm"), now=now)
    later = outbox.enqueue("node-a", wire.InstallEngine(engine="trt"), now=now + dt.timedelta(seconds=1))
    with CaptureQueriesContext(connection) as q:
        answer = renew(client, reporting, lease(acks=[str(again.id)])).json()
    assert len(q.captured_queries) == 2
    assert [c["id"] for c in answer["commands"]] == [str(later.id)]


def test_acks_of_another_nodes_commands_are_ignored(client, join_token, reporting, now):
    post(client, "register", register_payload("node-b"), join_token)
    theirs = outbox.enqueue("node-b", wire.InstallEngine(engine="sglang"), now=now)
    assert renew(client, reporting, lease(acks=[str(theirs.id)])).status_code == 200
    assert Command.objects.get(id=theirs.id).acked_at is None


def test_more_commands_than_an_answer_carries_says_come_back_at_once(client, reporting, now):
    Command.objects.bulk_create(
        Command(
            node_id="node-a",
            kind="install_engine",
            payload={"engine": f"e{i}"},
            created_at=now + dt.timedelta(microseconds=i),
        )
        for i in range(wire.MAX_COMMANDS + 3)
    )
    with CaptureQueriesContext(connection) as q:
        answer = wire.LeaseResponse.model_validate_json(renew(client, reporting).content)
    assert len(q.captured_queries) == 2
    assert (len(answer.commands), answer.again, answer.send_status) == (wire.MAX_COMMANDS, True, False)
    # Oldest first, as a heartbeat delivers them.
    assert [c.engine for c in answer.commands[:3]] == ["e0", "e1", "e2"]
    assert Command.objects.filter(deliveries=1).count() == wire.MAX_COMMANDS
    Command.objects.filter(id__in=[c.id for c in answer.commands]).update(acked_at=now)
    answer = wire.LeaseResponse.model_validate_json(renew(client, reporting).content)
    assert (len(answer.commands), answer.again) == (3, False)


def test_a_lost_status_is_asked_for_and_a_kept_one_lives_on(client, reporting):
    assert renew(client, reporting).json()["send_status"] is False
    assert telemetry.get("node-a")["ib_ports"]  # the last status is still there
    telemetry.forget("node-a")
    answer = renew(client, reporting).json()
    assert (answer["send_status"], answer["again"]) == (True, True)
    # The full heartbeat that follows puts it back.
    assert post(client, "heartbeat", heartbeat_payload(at=2.0, counters=20), reporting).status_code == 200
    assert renew(client, reporting).json()["send_status"] is False


def test_a_status_is_answered_with_the_digest_of_its_bytes_kept_beside_it(client, joined):
    body = json.dumps(heartbeat_payload(at=1.0, counters=10)).encode()
    answer = post(client, "heartbeat", body, joined).json()
    assert answer["status_digest"] == hb_rules.status_digest(body) == hashlib.blake2b(body, digest_size=16).hexdigest()
    assert cache.get(telemetry.digest_key("node-a")) == answer["status_digest"]
    # Another status, another digest (each carries the agent's clock).
    again = post(client, "heartbeat", heartbeat_payload(at=6.0, counters=10), joined).json()
    assert again["status_digest"] != answer["status_digest"]


def test_a_floor_naming_the_status_held_is_one_statement_and_leaves_the_status_as_it_was(client, reporting):
    digest = cache.get(telemetry.digest_key("node-a"))
    held = telemetry.get("node-a")
    # Both keys a few seconds from expiring: the floor gives them a whole time to live again.
    for k in (telemetry.key("node-a"), telemetry.digest_key("node-a")):
        cache.touch(k, 5)
    with CaptureQueriesContext(connection) as q:
        resp = renew(client, reporting, lease(status_digest=digest))
    assert resp.status_code == 200, resp.content
    assert [x["sql"][:40] for x in q.captured_queries] == ["UPDATE inventory_node AS n SET last_seen"]
    answer = wire.LeaseResponse.model_validate_json(resp.content)
    assert (answer.send_status, answer.again, answer.status_confirmed) == (False, False, True)
    assert telemetry.get("node-a") == held
    client_ = cache._cache.get_client(None)
    for k in (telemetry.key("node-a"), telemetry.digest_key("node-a")):
        assert client_.ttl(cache.make_and_validate_key(k)) > 100
    # An ordinary lease says nothing of a floor.
    assert renew(client, reporting).json()["status_confirmed"] is None


@pytest.mark.parametrize("lost", ["entry", "digest", "both"])
def test_a_floor_naming_a_status_the_control_plane_does_not_hold_asks_for_the_whole_one(client, reporting, lost):
    digest = cache.get(telemetry.digest_key("node-a"))
    if lost in ("entry", "both"):
        cache.delete(telemetry.key("node-a"))
    if lost in ("digest", "both"):
        cache.delete(telemetry.digest_key("node-a"))
    answer = renew(client, reporting, lease(status_digest=digest)).json()
    assert (answer["send_status"], answer["again"], answer["status_confirmed"]) == (True, True, False)


def test_a_floor_naming_another_status_asks_for_the_whole_one(client, reporting):
    # The cache holds a status this agent never had accepted (restored, or a replica behind): not confirmed.
    answer = renew(client, reporting, lease(status_digest="0" * 32)).json()
    assert (answer["send_status"], answer["again"], answer["status_confirmed"]) == (True, True, False)
    # Even on a lease that would not have checked the status otherwise.
    digest = cache.get(telemetry.digest_key("node-a"))
    assert renew(client, reporting, lease(status_digest=digest)).json()["status_confirmed"] is True


def test_a_floor_with_another_nodes_credential_is_403_and_confirms_nothing(client, join_token, reporting):
    other = post(client, "register", register_payload("node-b"), join_token).json()["credential"]
    digest = cache.get(telemetry.digest_key("node-a"))
    resp = renew(client, other, lease(status_digest=digest))
    assert resp.status_code == 403
    assert "status_confirmed" not in resp.json()


def test_a_floor_while_the_cache_is_down_is_confirmed_not_asked_for(client, reporting, settings):
    # Asking the fleet for statuses a cache that is down cannot keep would only load the control plane.
    digest = cache.get(telemetry.digest_key("node-a"))
    settings.CACHES = {
        "default": {
            "BACKEND": "llmgw.cache.RedisCache",
            "LOCATION": f"redis://127.0.0.1:{_closed_port()}/0",
            "OPTIONS": {"socket_connect_timeout": 0.5, "socket_timeout": 0.5},
        }
    }
    answer = renew(client, reporting, lease(status_digest=digest)).json()
    assert (answer["send_status"], answer["status_confirmed"]) == (False, True)


def test_most_leases_leave_the_cache_alone(client, reporting, monkeypatch):
    monkeypatch.setattr(agents.lease, "STATUS_CHECK_EVERY", 10**9)
    telemetry.forget("node-a")
    assert [renew(client, reporting).json()["send_status"] for _ in range(3)] == [False] * 3


def test_a_full_heartbeat_still_works_unchanged_and_offers_leases(client, joined):
    # An agent that sends everything, every time, as before.
    for at in (1.0, 6.0, 11.0):
        resp = post(client, "heartbeat", heartbeat_payload(at=at, counters=int(at)), joined)
        assert resp.status_code == 200
        assert resp.json()["leases"] is True
    assert telemetry.get("node-a")["agent_at"] == 11.0


def test_a_lease_wakes_an_unreachable_or_lost_node(client, reporting):
    for state in ("unreachable", "lost"):
        old = timezone.now() - dt.timedelta(hours=1)
        Node.objects.filter(id="node-a").update(last_seen=old, state=state, unreachable_since=old)
        assert renew(client, reporting).status_code == 200
        node = Node.objects.get(id="node-a")
        assert (node.state, node.unreachable_since, node.last_seen > old) == ("ready", None, True)
    assert NodeEvent.objects.filter(node_id="node-a", kind="state").count() >= 2


# --- the credential rules ------------------------------------------------------


def test_no_credential_or_an_unknown_one_is_401(client, reporting, join_token):
    for token in (None, "llmgw-node-unknown", "something-else", join_token):
        resp = renew(client, token)
        assert resp.status_code == 401, token
        assert resp["WWW-Authenticate"] == 'Bearer realm="llmgw-agent"'


def test_a_revoked_credential_is_401(client, reporting, now):
    assert credentials.reset("node-a", now=now)
    assert renew(client, reporting).status_code == 401


def test_another_nodes_credential_is_403_and_renews_nothing(client, join_token, reporting, now):
    other = post(client, "register", register_payload("node-b"), join_token).json()["credential"]
    old = timezone.now() - dt.timedelta(hours=1)
    Node.objects.update(last_seen=old, state="unreachable", unreachable_since=old)
    mine = outbox.enqueue("node-a", wire.InstallEngine(engine="sglang"), now=now)
    events = NodeEvent.objects.count()
    for body in (lease("node-b"), lease("node-zzz"), lease("node-b", acks=[str(mine.id)])):
        resp = renew(client, reporting, body)
        assert resp.status_code == 403
        assert resp.json() == {"detail": "this credential does not authorise requests about that node", "errors": []}
    # node-b's credential on node-a's lease, with node-a's command acknowledged: refused, nothing written.
    assert renew(client, other, lease("node-a", acks=[str(mine.id)])).status_code == 403
    assert list(Node.objects.order_by("id").values_list("last_seen", "state")) == [
        (old, "unreachable"),
        (old, "unreachable"),
    ]
    assert Command.objects.get(id=mine.id).acked_at is None
    assert NodeEvent.objects.count() == events
    assert renew(client, other, lease("node-b")).status_code == 200


def test_refusals_come_in_the_order_of_every_agent_endpoint(client, reporting):
    assert renew(client, "llmgw-node-wrong", b"{not json").status_code == 401
    assert renew(client, None, b"{not json").status_code == 401
    resp = renew(client, reporting, {"at": 1.0})
    assert resp.status_code == 400 and resp.json()["errors"][0]["field"] == "node_id"
    assert renew(client, reporting, lease(acks=["x"] * (wire.MAX_COMMANDS + 1))).status_code == 400
    assert renew(client, reporting, lease(padding="x" * MAX_LEASE_BODY)).status_code == 413
    auth = {"HTTP_AUTHORIZATION": f"Bearer {reporting}"}
    resp = client.post("/api/v1/agent/lease", data="x", content_type="text/plain", **auth)
    assert resp.status_code == 415
    assert client.get("/api/v1/agent/lease", **auth).status_code == 405


def test_rotation_by_lease(client, reporting, now):
    assert renew(client, reporting).json()["rotate_credential"] is None
    assert credentials.request_rotation("node-a", now=now)
    assert renew(client, reporting).json()["rotate_credential"] is True
    new = post(client, "rotate", {"node_id": "node-a"}, reporting).json()["credential"]
    # The answer may have been lost: the old secret still renews, until the new one is used.
    assert renew(client, reporting).status_code == 200
    answer = renew(client, new).json()
    assert answer["rotate_credential"] is None
    assert NodeCredential.objects.get(node_id="node-a").previous_hash is None
    assert renew(client, reporting).status_code == 401


def test_the_lease_is_in_the_openapi_document(client, operator):
    client.force_login(operator)
    doc = client.get("/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json").json()
    op = doc["paths"]["/api/v1/agent/lease"]["post"]
    assert op["operationId"] == "agent_lease"
    assert op["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].endswith("/LeaseResponse")
    assert {"401", "403", "400", "413", "415"} <= set(op["responses"])


# --- a real agent against the real endpoints ------------------------------------


def to_django(client, request: httpx.Request) -> httpx.Response:
    """An agent's request to the control plane, answered by Django's test client."""
    r = client.post(
        request.url.path,
        data=request.content,
        content_type="application/json",
        HTTP_AUTHORIZATION=request.headers["Authorization"],
    )
    return httpx.Response(r.status_code, content=r.content, headers={"Content-Type": "application/json"})


def agent_config(join_token: str, tmp_path):
    """agent.yaml of node-a against the control plane at http://cp."""
    return config_mod.parse(
        {"control_plane": "http://cp", "join_token": join_token, "node_id": "node-a", "state_dir": str(tmp_path)}
    )


def test_an_agent_sends_its_status_then_leases_until_something_changes(client, join_token, tmp_path):
    paths: list[str] = []

    def through_django(request: httpx.Request) -> httpx.Response:
        paths.append(request.url.path)
        return to_django(client, request)

    cfg = agent_config(join_token, tmp_path)
    probe = Probe()
    http = httpx.Client(base_url="http://cp", transport=httpx.MockTransport(through_django))
    # What listens here held still: other programs on a shared test machine come and go, and each change
    # is rightly a status of its own.
    agent = Agent(cfg, probe=probe, http=http, listening=lambda: [22])
    try:
        for _ in range(3):
            agent.step()
        assert paths == ["/api/v1/agent/register", "/api/v1/agent/heartbeat", wire.LEASE_PATH, wire.LEASE_PATH]
        # A card warms by 10 °C: status.
        probe.sample = lambda previous=None: Sampled(gpus=[wire.GPUSensor(index=0, temp_c=50)])
        agent.step()
        assert paths[-1] == "/api/v1/agent/heartbeat" and agent.status.reason == "gpu 0 temperature"
        assert telemetry.get("node-a")["gpus"][0]["temp_c"] == 50
        # A command comes with a lease; applying it changes the engine installs, so its ack rides in a status.
        cmd = outbox.enqueue("node-a", wire.InstallEngine(engine="sglang"), now=timezone.now())
        agent.step()
        assert paths[-1] == wire.LEASE_PATH and "sglang" in agent.installs
        agent.step()
        assert paths[-1] == "/api/v1/agent/heartbeat" and agent.status.reason == "engine installs"
        assert Command.objects.get(id=cmd.id).acked_at is not None
        # The control plane lost the status: the lease's answer asks for it, and the agent comes back at once.
        telemetry.forget("node-a")
        agent.step()
        assert paths[-1] == wire.LEASE_PATH and agent.status.wait_s(5.0) == 0.0
        agent.step()
        assert paths[-1] == "/api/v1/agent/heartbeat" and agent.status.reason == "asked"
        assert telemetry.get("node-a") is not None
    finally:
        agent.close()


def _floor_agent(client, join_token, tmp_path, *, older_lease_endpoint: bool = False):
    """node-a's agent on a clock the test moves, its requests answered by Django and listed as (path, Priority, body).

    Each body is kept parsed, and as sent (a fourth item, its bytes).

    `older_lease_endpoint`: lease answers lose status_confirmed, as from a lease endpoint that knows no digests.
    """
    sent: list[tuple[str, str | None, dict, bytes]] = []

    def through_django(request: httpx.Request) -> httpx.Response:
        sent.append((request.url.path, request.headers.get("Priority"), json.loads(request.content), request.content))
        r = to_django(client, request)
        if older_lease_endpoint and request.url.path == wire.LEASE_PATH and r.status_code == 200:
            answer = r.json()
            answer.pop("status_confirmed", None)
            r = httpx.Response(200, json=answer)
        return r

    now = [1_000.0]
    probe = Probe()
    http = httpx.Client(base_url="http://cp", transport=httpx.MockTransport(through_django))
    agent = Agent(
        agent_config(join_token, tmp_path), probe=probe, http=http, listening=lambda: [22], clock=lambda: now[0]
    )
    return agent, probe, now, sent


HB = "/api/v1/agent/heartbeat"


def test_the_floor_goes_as_the_digest_of_the_status_held_and_a_status_only_when_the_control_plane_lost_it(
    client, join_token, tmp_path
):
    agent, probe, now, sent = _floor_agent(client, join_token, tmp_path)
    try:
        agent.step()
        agent.step()
        # A minute on, the first fabric report (new to the control plane): a status, whose digest comes back.
        now[0] += 60
        agent.step()
        assert (sent[-1][0], agent.status.reason) == (HB, "gpu fabrics")
        held = telemetry.get("node-a")
        digest = agent.status.digest
        assert digest == hb_rules.status_digest(sent[-1][3])
        # The floor, nothing changed: a lease carrying that digest; confirmed, the status held is left as it was.
        now[0] += 60
        before = len(sent)
        agent.step()
        floors = [(p, prio, b.get("status_digest")) for p, prio, b, _ in sent[before:]]
        assert floors == [(wire.LEASE_PATH, None, digest)]
        assert agent.status.reason == "floor" and agent.status.last_at == now[0]
        assert telemetry.get("node-a") == held
        # Leases within the minute after, and the next floor is a minute after the confirmed one.
        now[0] += 30
        agent.step()
        assert sent[-1][0] == wire.LEASE_PATH and "status_digest" not in sent[-1][2]
        now[0] += 30
        agent.step()
        assert sent[-1][2]["status_digest"] == digest
        # The control plane lost the status (a cache flushed): the floor's answer asks for it, and it comes at once.
        telemetry.forget("node-a")
        now[0] += 60
        agent.step()
        assert sent[-1][2]["status_digest"] == digest and agent.status.wait_s(5.0) == 0.0
        agent.step()
        assert (sent[-1][0], sent[-1][1], agent.status.reason) == (HB, None, "asked")
        assert agent.status.digest not in (None, digest)
        # A card 10 °C warmer at the floor: the change goes as a status, urgent as ever.
        now[0] += 60
        probe.sample = lambda previous=None: Sampled(gpus=[wire.GPUSensor(index=0, temp_c=50)])
        agent.step()
        assert (sent[-1][0], sent[-1][1], agent.status.reason) == (HB, None, "gpu 0 temperature")
    finally:
        agent.close()


def test_a_floor_a_lease_endpoint_does_not_confirm_goes_whole_next_and_routine(client, join_token, tmp_path):
    # RFC 9218's least urgency on the floor's status alone: the web tier serves it after the others
    # (llmgw/front.py). It goes whole only where the digest was not checked (an older lease endpoint).
    agent, _probe, now, sent = _floor_agent(client, join_token, tmp_path, older_lease_endpoint=True)
    try:
        agent.step()
        agent.step()
        now[0] += 60
        agent.step()  # the first fabric report
        now[0] += 60
        agent.step()
        assert sent[-1][0] == wire.LEASE_PATH and sent[-1][2]["status_digest"] == agent.status.digest
        assert agent.status.digest_unconfirmed is True
        agent.step()
        assert (sent[-1][0], sent[-1][1], agent.status.reason) == (HB, "u=7", "floor")
        # Accepted, the status gives a digest again, and the next floor tries it again.
        assert agent.status.digest_unconfirmed is False
        now[0] += 60
        agent.step()
        assert sent[-1][0] == wire.LEASE_PATH and sent[-1][2]["status_digest"] == agent.status.digest
    finally:
        agent.close()


def test_a_lease_is_routine_logged_at_debug_only(client, reporting, caplog):
    # Every node renews every few seconds: nothing at INFO, one line at DEBUG.
    with caplog.at_level(logging.INFO):
        assert renew(client, reporting).status_code == 200
    assert caplog.records == []
    with caplog.at_level(logging.DEBUG):
        assert renew(client, reporting).status_code == 200
    assert [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "agents.lease"] == [
        ("DEBUG", "lease: node node-a renewed, 0 commands")
    ]
