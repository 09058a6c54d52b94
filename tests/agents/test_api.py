"""The agent endpoints over HTTP: authentication, the node authorizer, bad input, commands."""

from __future__ import annotations

import datetime as dt
import socket

import pytest
from django.utils import timezone
from prometheus_client import REGISTRY

import llmgw_wire as wire
from agents import credentials
from agents.api import MAX_HEARTBEAT_BODY
from agents.models import JoinToken, NodeCredential
from inventory import changes, outbox, telemetry
from inventory.models import GPU, Command, FabricScan, Node, NodeEvent
from tests.agents.conftest import heartbeat_payload, make_shard, post
from tests.factories import register_payload

pytestmark = pytest.mark.django_db


def test_join_with_bootstrap_token_issues_a_credential_stored_hashed(client, join_token):
    resp = post(client, "register", register_payload("node-a"), join_token)
    assert resp.status_code == 200
    body = resp.json()
    secret = body["credential"]
    assert secret.startswith("llmgw-node-") and len(secret) > 40
    assert body["node_id"] == "node-a"
    assert body["heartbeat_interval_s"] == 5.0
    cred = NodeCredential.objects.get(node_id="node-a")
    assert cred.token_hash == credentials.hash_secret(secret)
    assert secret not in cred.token_hash
    assert cred.issued_by == "bootstrap token"
    assert GPU.objects.filter(node_id="node-a").count() == 8


def test_a_new_node_running_shards_it_cannot_know_gets_their_stops_in_its_first_answer(client, join_token):
    # A new node's shards and commands are not read (it can have none in the database),
    # but what it reports running is still fenced, and the fence delivered at once.
    running = {"replica_id": "r1", "shard_id": "00000000-0000-0000-0000-000000000001", "state": "ready"}
    resp = post(client, "register", register_payload("node-a", running_shards=[running]), join_token)
    assert resp.status_code == 200, resp.content
    body = resp.json()
    assert body["adopted"] == []
    assert [(c["kind"], c["shard_id"], c["reason"]) for c in body["commands"]] == [
        ("stop_shard", "00000000-0000-0000-0000-000000000001", "shard unknown to the control plane")
    ]
    assert list(Command.objects.filter(node_id="node-a").values_list("kind", "deliveries")) == [("stop_shard", 1)]
    assert list(NodeEvent.objects.filter(node_id="node-a").order_by("id").values_list("kind", "message")) == [
        ("registered", "node joined"),
        ("credential", "credential issued (bootstrap token)"),
    ]


def test_a_known_node_whose_credential_was_reset_joins_again_with_a_new_one(client, join_token, joined, now):
    assert credentials.reset("node-a", now=now)
    resp = post(client, "register", register_payload("node-a", hostname="reinstalled"), join_token)
    assert resp.status_code == 200, resp.content
    secret = resp.json()["credential"]
    assert NodeCredential.objects.get(node_id="node-a").token_hash == credentials.hash_secret(secret)
    assert Node.objects.get(id="node-a").hostname == "reinstalled"
    assert list(NodeEvent.objects.filter(node_id="node-a").order_by("id").values_list("message", flat=True))[-2:] == [
        "agent re-registered",
        "credential issued (bootstrap token)",
    ]


def test_reregistration_with_own_credential_issues_none(client, joined):
    resp = post(client, "register", register_payload("node-a", hostname="renamed"), joined)
    assert resp.status_code == 200
    assert resp.json()["credential"] is None
    assert Node.objects.get(id="node-a").hostname == "renamed"
    assert NodeCredential.objects.get(node_id="node-a").token_hash == credentials.hash_secret(joined)


@pytest.mark.parametrize("header", [None, "Bearer", "Bearer nonsense", "Basic abc", "Bearer llmgw-node-wrong"])
def test_missing_or_wrong_credentials_are_401(client, joined, header):
    extra = {"HTTP_AUTHORIZATION": header} if header else {}
    for path, body in [("register", register_payload("node-a")), ("heartbeat", heartbeat_payload())]:
        resp = client.post(f"/api/v1/agent/{path}", data=body, content_type="application/json", **extra)
        assert resp.status_code == 401
        assert resp["WWW-Authenticate"].startswith("Bearer")
        assert resp.json() == {"detail": "missing or invalid credentials", "errors": []}


def test_operator_session_is_not_an_agent(client, operator, viewer):
    for user in (operator, viewer):
        client.force_login(user)
        resp = post(client, "heartbeat", heartbeat_payload(), None)
        assert resp.status_code == 401


def test_credential_of_another_node_is_403_without_detail(client, join_token, joined):
    other = post(client, "register", register_payload("node-b"), join_token).json()["credential"]
    Node.objects.filter(id="node-b").update(hostname="secret-host")
    before = NodeEvent.objects.count()
    for path, body in [
        ("heartbeat", heartbeat_payload("node-b")),
        ("register", register_payload("node-b")),
        ("scans", {"node_id": "node-b", "key": "sm:0x1", "output": "x"}),
        ("rotate", {"node_id": "node-b"}),
        ("heartbeat", heartbeat_payload("node-zzz")),
    ]:
        resp = post(client, path, body, joined)
        assert resp.status_code == 403, path
        assert resp.json() == {"detail": "this credential does not authorise requests about that node", "errors": []}
        assert b"node-b" not in resp.content and b"secret-host" not in resp.content
    assert NodeEvent.objects.count() == before
    assert Node.objects.get(id="node-b").hostname == "secret-host"
    assert post(client, "heartbeat", heartbeat_payload("node-b"), other).status_code == 200


def test_join_token_cannot_take_over_a_node_until_reset(client, join_token, joined, now):
    resp = post(client, "register", register_payload("node-a"), join_token)
    assert resp.status_code == 403
    assert NodeCredential.objects.get(node_id="node-a").token_hash == credentials.hash_secret(joined)

    assert credentials.reset("node-a", now=now)
    assert post(client, "heartbeat", heartbeat_payload(), joined).status_code == 401
    resp = post(client, "register", register_payload("node-a"), join_token)
    assert resp.status_code == 200
    fresh = resp.json()["credential"]
    assert fresh and fresh != joined
    assert post(client, "heartbeat", heartbeat_payload(), fresh).status_code == 200
    assert NodeEvent.objects.filter(node_id="node-a", kind="credential").count() == 3


def test_join_token_cannot_heartbeat(client, join_token, joined):
    assert post(client, "heartbeat", heartbeat_payload(), join_token).status_code == 401
    assert post(client, "scans", {"node_id": "node-a", "key": "k"}, join_token).status_code == 401


def test_admin_join_token_expiry_and_use_limit(client, now):
    t0 = timezone.now()
    token, secret = credentials.create_join_token(
        name="rack 7", expires_at=t0 + dt.timedelta(hours=1), max_uses=1, now=t0
    )
    assert post(client, "register", register_payload("node-a"), secret).status_code == 200
    token.refresh_from_db()
    assert token.uses == 1
    # Used up: a second node is refused, and nothing of it is written.
    assert post(client, "register", register_payload("node-b"), secret).status_code == 401
    assert not Node.objects.filter(id="node-b").exists()

    expired, old = credentials.create_join_token(
        name="old", expires_at=t0 - dt.timedelta(seconds=1), max_uses=None, now=t0
    )
    assert post(client, "register", register_payload("node-c"), old).status_code == 401
    revoked, gone = credentials.create_join_token(
        name="r", expires_at=t0 + dt.timedelta(hours=1), max_uses=None, now=t0
    )
    assert credentials.revoke_join_token(revoked.id, now=t0)
    assert post(client, "register", register_payload("node-d"), gone).status_code == 401
    assert JoinToken.objects.get(id=expired.id).uses == 0


NONCE = "n" * 43


def test_a_join_retried_after_its_answer_was_lost_gets_a_credential(client):
    """A registration storm: the agent timed out, the server went on; the retry must not be locked out."""
    t0 = timezone.now()
    token, secret = credentials.create_join_token(
        name="rack 7", expires_at=t0 + dt.timedelta(hours=1), max_uses=1, now=t0
    )
    first = post(client, "register", register_payload("node-a", join_nonce=NONCE), secret)
    assert first.status_code == 200
    # The answer never arrived. The retry: same node, same (now used-up) token, same nonce.
    retry = post(client, "register", register_payload("node-a", join_nonce=NONCE), secret)
    assert retry.status_code == 200, retry.content
    credential = retry.json()["credential"]
    assert credential.startswith(credentials.NODE_PREFIX) and credential != first.json()["credential"]
    # The use was counted once; the retried credential is the one that works now.
    token.refresh_from_db()
    assert token.uses == 1
    assert post(client, "heartbeat", heartbeat_payload(), credential).status_code == 200
    assert post(client, "heartbeat", heartbeat_payload(), first.json()["credential"]).status_code == 401
    assert list(
        NodeEvent.objects.filter(node_id="node-a", kind="credential").order_by("id").values_list("message", flat=True)
    ) == ["credential issued (rack 7)", "credential issued again: a retried join (rack 7)"]


def test_a_join_retry_needs_the_same_nonce_token_and_window(client, settings):
    settings.LLMGW_JOIN_RETRY_WINDOW = 600
    t0 = timezone.now()
    token, secret = credentials.create_join_token(
        name="rack 7", expires_at=t0 + dt.timedelta(hours=1), max_uses=5, now=t0
    )
    other, other_secret = credentials.create_join_token(
        name="rack 8", expires_at=t0 + dt.timedelta(hours=1), max_uses=5, now=t0
    )
    assert post(client, "register", register_payload("node-a", join_nonce=NONCE), secret).status_code == 200
    refused = [
        post(client, "register", register_payload("node-a", join_nonce="m" * 43), secret),  # another agent
        post(client, "register", register_payload("node-a"), secret),  # no nonce
        post(client, "register", register_payload("node-a", join_nonce=NONCE), other_secret),  # another token
    ]
    assert [r.status_code for r in refused] == [403, 403, 403]
    # Past the window, or once the credential was rotated, it is a takeover: refused.
    NodeCredential.objects.update(issued_at=t0 - dt.timedelta(seconds=601))
    assert post(client, "register", register_payload("node-a", join_nonce=NONCE), secret).status_code == 403
    token.refresh_from_db()
    other.refresh_from_db()
    assert (token.uses, other.uses) == (1, 0)


def test_the_last_use_of_a_join_token_goes_to_one_node(now):
    token, secret = credentials.create_join_token(name="x", expires_at=now + dt.timedelta(hours=1), max_uses=1, now=now)
    # Two registrations both saw the token usable; the use is re-checked as it is counted.
    first = credentials.check_join_token(secret, now=now)
    second = credentials.check_join_token(secret, now=now)
    assert first is not None and second is not None
    assert credentials.consume_join_token(first, now=now)
    assert not credentials.consume_join_token(second, now=now)
    token.refresh_from_db()
    assert token.uses == 1


def test_join_token_use_is_not_counted_when_the_registration_is_refused(client, now):
    t0 = timezone.now()
    token, secret = credentials.create_join_token(name="x", expires_at=t0 + dt.timedelta(hours=1), max_uses=1, now=t0)
    bad = register_payload("node-a", gpus=[{"index": 0, "compute_capability": "x" * 40}])
    assert post(client, "register", bad, secret).status_code == 400
    token.refresh_from_db()
    assert token.uses == 0


def test_wrong_content_type_is_415(client, joined):
    resp = client.post(
        "/api/v1/agent/heartbeat",
        data="node_id=node-a",
        content_type="text/plain",
        HTTP_AUTHORIZATION=f"Bearer {joined}",
    )
    assert resp.status_code == 415
    assert resp.json()["detail"] == "the body must be application/json"


def test_oversized_body_is_413(client, joined):
    body = heartbeat_payload(padding="x" * (MAX_HEARTBEAT_BODY + 1))
    resp = post(client, "heartbeat", body, joined)
    assert resp.status_code == 413
    assert resp.json()["detail"] == f"the body must be at most {MAX_HEARTBEAT_BODY} bytes"


@pytest.mark.parametrize(
    ("path", "body", "field", "problem"),
    [
        ("heartbeat", b"{not json", "(body)", "Invalid JSON"),
        ("heartbeat", [1, 2], "(body)", "Input should be an object"),
        ("heartbeat", {"node_id": "node-a", "gpus": [{"index": 64}]}, "gpus.0.index", "Input should be less than 64"),
        ("heartbeat", {"node_id": "node-a", "shards": [{"shard_id": "s"}]}, "shards.0.state", "Field required"),
        (
            "heartbeat",
            {"node_id": "node-a", "ib_ports": [{"hca": "m", "port": 1, "counters": {"x": -1}}]},
            "ib_ports.0.counters.x",
            "Input should be greater than or equal to 0",
        ),
        ("register", {"node_id": "node a"}, "node_id", "String should match pattern"),
        (
            "register",
            register_payload("node-a", gpus=[{"index": 0, "compute_capability": "9" * 17}]),
            "gpus.0.compute_capability",
            "String should have at most 16 characters",
        ),
        (
            "register",
            register_payload("node-a", gpus=[{"index": 1}, {"index": 1}]),
            "gpus",
            "Value error, GPU index 1 appears twice",
        ),
        # A scrape target for Prometheus: host:port and nothing more.
        (
            "register",
            register_payload("node-a", metrics_addr="http://evil.example/x?y=1"),
            "metrics_addr",
            "String should match pattern",
        ),
        ("scans", {"node_id": "node-a"}, "key", "Field required"),
    ],
)
def test_bad_input_is_400_naming_the_field(client, joined, path, body, field, problem):
    resp = post(client, path, body, joined)
    assert resp.status_code == 400, resp.content
    errors = resp.json()["errors"]
    assert any(e["field"] == field and e["problem"].startswith(problem) for e in errors), errors


def test_heartbeat_port_names_and_guids_the_inventory_cannot_hold_are_400(client, joined):
    def port(hca: str, guid: str) -> dict:
        return {"hca": hca, "port": 255, "sm_guid": guid}

    fits = [port("h" * 124, "0x" + "f" * 62), port("h", "1"), port("h", "g" * 64)]
    assert post(client, "heartbeat", heartbeat_payload(ib_ports=fits), joined).status_code == 200
    # "h" * 125 + "/255" is 129 characters; a GUID of 63 hex digits is 65 once spelt with its 0x.
    bad = [port("h" * 125, "0x1"), port("h", "f" * 63)]
    resp = post(client, "heartbeat", heartbeat_payload(ib_ports=bad), joined)
    assert resp.status_code == 400
    assert resp.json()["errors"] == [
        {"field": "ib_ports.0.hca", "problem": "String should have at most 128 characters"},
        {"field": "ib_ports.1.sm_guid", "problem": "String should have at most 64 characters"},
    ]


def test_bad_registration_writes_nothing(client, joined):
    node = Node.objects.get(id="node-a")
    events = NodeEvent.objects.count()
    bad = register_payload("node-a", hostname="changed", gpus=[{"index": 0, "pci_bus_id": "p" * 65}])
    assert post(client, "register", bad, joined).status_code == 400
    assert Node.objects.get(id="node-a").hostname == node.hostname
    assert GPU.objects.filter(node_id="node-a").count() == 8
    assert NodeEvent.objects.count() == events


def test_a_refused_heartbeat_renews_no_lease_and_wakes_no_node(client, join_token, joined):
    post(client, "register", register_payload("node-b"), join_token)
    old = timezone.now() - dt.timedelta(hours=1)
    Node.objects.update(last_seen=old, state="unreachable", unreachable_since=old)
    events = NodeEvent.objects.count()
    refusals = [
        (post(client, "heartbeat", heartbeat_payload("node-b"), joined), 403),
        (post(client, "heartbeat", heartbeat_payload(gpus=[{"index": 64}]), joined), 400),
        (post(client, "heartbeat", heartbeat_payload(padding="x" * (MAX_HEARTBEAT_BODY + 1)), joined), 413),
        (
            client.post(
                "/api/v1/agent/heartbeat", data="x", content_type="text/plain", HTTP_AUTHORIZATION=f"Bearer {joined}"
            ),
            415,
        ),
        # A stranger learns nothing about the body: the credential is refused first.
        (post(client, "heartbeat", b"{not json", "llmgw-node-wrong"), 401),
    ]
    assert [r.status_code for r, _ in refusals] == [code for _, code in refusals]
    assert list(Node.objects.values_list("last_seen", "state", "unreachable_since")) == [
        (old, "unreachable", old),
        (old, "unreachable", old),
    ]
    assert NodeEvent.objects.count() == events
    assert post(client, "heartbeat", heartbeat_payload(), joined).status_code == 200
    node = Node.objects.get(id="node-a")
    assert (node.last_seen > old, node.state, node.unreachable_since) == (True, "ready", None)


def test_commands_are_delivered_until_acknowledged_never_after(client, joined, now):
    cmd = outbox.enqueue("node-a", wire.InstallEngine(engine="vllm", version="0.11.0"), now=now)
    first = post(client, "heartbeat", heartbeat_payload(), joined).json()["commands"]
    assert first == [
        {"kind": "install_engine", "id": str(cmd.id), "engine": "vllm", "version": "0.11.0", "variant": ""}
    ]
    again = post(client, "heartbeat", heartbeat_payload(), joined).json()["commands"]
    assert again == first
    cmd.refresh_from_db()
    assert cmd.deliveries == 2 and cmd.first_delivered_at is not None and cmd.acked_at is None
    acked = post(client, "heartbeat", heartbeat_payload(acks=[str(cmd.id)]), joined).json()["commands"]
    assert acked == []
    cmd.refresh_from_db()
    assert cmd.acked_at is not None and cmd.deliveries == 2
    assert post(client, "heartbeat", heartbeat_payload(), joined).json()["commands"] == []


def test_commands_come_in_queue_order_with_a_fence_the_same_heartbeat_queued(
    client, joined, now, django_assert_num_queries
):
    shard = make_shard("node-a", now=now)
    stranger = "00000000-0000-4000-8000-000000000001"
    # Queued before the heartbeat (its fence is stamped with the request's own time).
    before = timezone.now() - dt.timedelta(minutes=1)
    queued = [
        outbox.enqueue("node-a", wire.InstallEngine(engine=f"e{i}"), now=before + dt.timedelta(seconds=s))
        for i, s in enumerate([3, 1, 2])
    ]
    acked = outbox.enqueue("node-a", wire.InstallEngine(engine="acked"), now=before)
    shards = [
        {"shard_id": str(shard.id), "replica_id": str(shard.replica_id), "state": "ready"},
        {"shard_id": stranger, "replica_id": "r", "state": "ready"},
    ]
    body = post(client, "heartbeat", heartbeat_payload(shards=shards, acks=[str(acked.id)]), joined).json()
    # Oldest first; the acknowledged one is not sent again; the fence of the unknown shard comes last.
    assert [(c["kind"], c.get("engine") or c.get("shard_id")) for c in body["commands"]] == [
        ("install_engine", "e1"),
        ("install_engine", "e2"),
        ("install_engine", "e0"),
        ("stop_shard", stranger),
    ]
    assert [c["id"] for c in body["commands"][:3]] == [str(queued[i].id) for i in (1, 2, 0)]
    # The fence is pending already: nothing new is queued, and the same commands come with the shards' read.
    # Lease and shards-with-commands, the pending fence looked up, the deliveries marked, the savepoint pair.
    with django_assert_num_queries(2 + 1 + 1 + 2):
        again = post(client, "heartbeat", heartbeat_payload(shards=shards), joined).json()["commands"]
    assert again == body["commands"]
    assert sorted(Command.objects.filter(acked_at__isnull=True).values_list("deliveries", flat=True)) == [2] * 4


def test_a_shard_starting_is_not_a_change_to_the_placement_index_but_a_shard_ending_is(client, joined, now):
    # The index reads a shard's ports, held until the shard ends; its progress towards ready is not its business.
    shard = make_shard("node-a", now=now, state="starting", replica_state="starting")
    start = [{"shard_id": str(shard.id), "replica_id": str(shard.replica_id), "state": "starting"}]
    # The first heartbeat's telemetry is news to the index (its ports, its power limits): read before counting.
    assert post(client, "heartbeat", heartbeat_payload(shards=start), joined).status_code == 200
    version = changes.current_version()
    for state in ("loading", "ready"):
        report = [{"shard_id": str(shard.id), "replica_id": str(shard.replica_id), "state": state}]
        assert post(client, "heartbeat", heartbeat_payload(shards=report), joined).status_code == 200
        shard.refresh_from_db()
        assert shard.state == state
    assert changes.since(version).node_ids == frozenset()
    report = [{"shard_id": str(shard.id), "replica_id": str(shard.replica_id), "state": "failed", "reason": "oom"}]
    assert post(client, "heartbeat", heartbeat_payload(shards=report), joined).status_code == 200
    assert changes.since(version).node_ids == frozenset({"node-a"})


def test_acks_of_another_nodes_commands_are_ignored(client, join_token, joined, now):
    post(client, "register", register_payload("node-b"), join_token)
    theirs = outbox.enqueue("node-b", wire.InstallEngine(engine="vllm"), now=now)
    assert post(client, "heartbeat", heartbeat_payload(acks=[str(theirs.id), "not-a-uuid"]), joined).status_code == 200
    assert Command.objects.get(id=theirs.id).acked_at is None


def test_scan_upload_keeps_the_text_and_acknowledges(client, joined, now):
    cmd = outbox.enqueue("node-a", wire.ScanFabric(key="sm:0x1", hca="mlx5_0"), now=now)
    resp = post(
        client,
        "scans",
        {
            "node_id": "node-a",
            "command_id": str(cmd.id),
            "key": "sm:0x1",
            "hca": "mlx5_0",
            "port": 1,
            "output": "Switch 36 ...",
            "took_s": 2.5,
        },
        joined,
    )
    assert resp.status_code == 200
    assert resp.json()["has_output"] is True and resp.json()["error"] == ""
    scan = FabricScan.objects.get(key="sm:0x1")
    assert (scan.node_id, scan.port, scan.output, scan.took_s) == ("node-a", "mlx5_0/1", "Switch 36 ...", 2.5)
    assert Command.objects.get(id=cmd.id).acked_at is not None
    again = outbox.enqueue("node-a", wire.ScanFabric(key="sm:0x1", hca="mlx5_0"), now=now)
    body = {"node_id": "node-a", "command_id": str(again.id), "key": "sm:0x1", "error": "timeout"}
    failed = post(client, "scans", body, joined).json()
    assert failed["error"] == "timeout" and failed["has_output"] is True


def _scan(cmd_id, key="sm:0x1", **extra) -> dict:
    return {"node_id": "node-a", "command_id": str(cmd_id), "key": key, "hca": "mlx5_0", "port": 1, **extra}


def test_scan_upload_without_a_command_of_this_node_is_403_and_writes_nothing(client, join_token, joined, now):
    post(client, "register", register_payload("node-b"), join_token)
    theirs = outbox.enqueue("node-b", wire.ScanFabric(key="sm:0x2", hca="mlx5_0"), now=now)
    mine = outbox.enqueue("node-a", wire.ScanFabric(key="sm:0x1", hca="mlx5_0"), now=now)
    FabricScan.objects.create(key="sm:0x2", at=now, node_id="node-b", output="the real map")
    cases = [
        ({"node_id": "node-a", "key": "sm:0x2", "output": "# forged"}, "must name the scan command"),
        (_scan(theirs.id, key="sm:0x2", output="# forged"), "no scan was asked of this node"),
        (_scan(mine.id, key="sm:0x2", output="# forged"), "another fabric key"),
        (_scan(mine.id, key="sm:junk", output="# forged"), "another fabric key"),
        ({**_scan(mine.id, output="# forged"), "hca": "mlx5_9"}, "another port"),
    ]
    for body, why in cases:
        resp = post(client, "scans", body, joined)
        assert resp.status_code == 403, body
        assert why in resp.json()["detail"]
    assert FabricScan.objects.get(key="sm:0x2").output == "the real map"
    assert not FabricScan.objects.filter(key__in=["sm:junk", "sm:0x1"]).exists()
    assert Command.objects.get(id=mine.id).acked_at is None
    assert Command.objects.get(id=theirs.id).acked_at is None


def test_a_scan_command_is_answered_once(client, joined, now):
    cmd = outbox.enqueue("node-a", wire.ScanFabric(key="sm:0x1", hca="mlx5_0"), now=now)
    assert post(client, "scans", _scan(cmd.id, output="first"), joined).status_code == 200
    resp = post(client, "scans", _scan(cmd.id, output="# replayed"), joined)
    assert resp.status_code == 403
    assert resp.json()["detail"] == "this scan command was already answered"
    assert FabricScan.objects.get(key="sm:0x1").output == "first"


def test_rotation_keeps_the_old_secret_until_the_new_one_is_used(client, joined):
    resp = post(client, "rotate", {"node_id": "node-a"}, joined)
    assert resp.status_code == 200
    new = resp.json()["credential"]
    assert new and new != joined
    # The answer may have been lost: the old secret still works.
    assert post(client, "heartbeat", heartbeat_payload(), joined).status_code == 200
    assert post(client, "heartbeat", heartbeat_payload(), new).status_code == 200
    assert NodeCredential.objects.get(node_id="node-a").previous_hash is None
    assert post(client, "heartbeat", heartbeat_payload(), joined).status_code == 401


def test_operator_requested_rotation_is_announced_in_heartbeats(client, joined, now):
    assert post(client, "heartbeat", heartbeat_payload(), joined).json()["rotate_credential"] is None
    assert credentials.request_rotation("node-a", now=now)
    assert post(client, "heartbeat", heartbeat_payload(), joined).json()["rotate_credential"] is True
    new = post(client, "rotate", {"node_id": "node-a"}, joined).json()["credential"]
    assert post(client, "heartbeat", heartbeat_payload(), new).json()["rotate_credential"] is None


def test_wire_schemas_are_in_the_openapi_document(client, operator):
    # OpenAPI 3.1: its schemas are JSON Schema 2020-12, which pydantic writes.
    client.force_login(operator)
    doc = client.get("/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json").json()
    assert doc["openapi"] == "3.1.0"
    for path in ("register", "heartbeat", "scans", "rotate"):
        assert f"/api/v1/agent/{path}" in doc["paths"]
    schemas = doc["components"]["schemas"]
    # Request bodies get a "Request" suffix (COMPONENT_SPLIT_REQUEST).
    for name in (
        "RegisterRequest",
        "RegisterResponse",
        "HeartbeatRequest",
        "HeartbeatResponse",
        "StartShard",
        "StopShard",
        "ScanFabric",
        "InstallEngine",
        "ScanUploadRequest",
        "GPUSensor",
        "IBPort",
        "Problem",
    ):
        assert name in schemas, name
    hb = doc["paths"]["/api/v1/agent/heartbeat"]["post"]
    assert hb["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/HeartbeatRequest"
    }
    assert schemas["ShardStatus"]["properties"]["state"]["$ref"] == "#/components/schemas/ShardState"


@pytest.mark.parametrize(
    ("path", "change", "field"),
    [
        ("register", {"hostname": "h\x00"}, "hostname"),
        ("register", {"labels": {"rack": "r\x00"}}, "labels.rack"),
        ("register", {"engine_installs": [{"engine": "vllm\x00", "state": "ready"}]}, "engine_installs.0.engine"),
        ("heartbeat", {"shards": [{"shard_id": "s\x00", "state": "ready"}]}, "shards.0.shard_id"),
        (
            "heartbeat",
            {"engine_installs": [{"engine": "vllm", "state": "ready", "detail": "\x00"}]},
            "engine_installs.0.detail",
        ),
    ],
)
def test_nul_characters_from_an_agent_are_400_naming_the_field(client, joined, path, change, field):
    base = register_payload("node-a") if path == "register" else heartbeat_payload()
    before = Node.objects.filter(id="node-a").values().first()
    resp = post(client, path, {**base, **change}, joined)
    assert resp.status_code == 400
    assert resp.json()["errors"] == [{"field": field, "problem": "Null characters are not allowed."}]
    assert Node.objects.filter(id="node-a").values().first() == before


def test_nul_in_scan_text_is_400(client, joined, now):
    cmd = outbox.enqueue("node-a", wire.ScanFabric(key="sm:0x1", hca="mlx5_0"), now=now)
    body = {"node_id": "node-a", "command_id": str(cmd.id), "key": "sm:0x1", "output": "Switch\x00"}
    resp = post(client, "scans", body, joined)
    assert resp.status_code == 400
    assert resp.json()["errors"] == [{"field": "output", "problem": "Null characters are not allowed."}]
    assert not FabricScan.objects.exists()
    assert Command.objects.get(id=cmd.id).acked_at is None


def test_a_heartbeat_answer_carries_at_most_the_commands_an_agent_accepts(client, joined, now):
    Command.objects.bulk_create(
        Command(node_id="node-a", kind="install_engine", payload={"engine": f"e{i}"}, created_at=now)
        for i in range(wire.MAX_COMMANDS + 10)
    )
    body = post(client, "heartbeat", heartbeat_payload(), joined).content
    answer = wire.HeartbeatResponse.model_validate_json(body)
    assert len(answer.commands) == wire.MAX_COMMANDS


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_cache_outage_costs_no_lease(client, joined, settings):
    """Redis down: the heartbeat renews the lease and answers 200; the telemetry is skipped and counted."""
    before = REGISTRY.get_sample_value("llmgw_telemetry_cache_errors_total", {"op": "put"}) or 0.0
    old = timezone.now() - dt.timedelta(hours=1)
    Node.objects.update(last_seen=old, state="unreachable", unreachable_since=old)
    settings.CACHES = {
        "default": {
            "BACKEND": "llmgw.cache.RedisCache",
            "LOCATION": f"redis://127.0.0.1:{_closed_port()}/0",
            "OPTIONS": {"socket_connect_timeout": 0.5, "socket_timeout": 0.5},
        }
    }
    r = post(client, "heartbeat", heartbeat_payload(), joined)
    assert r.status_code == 200, r.content
    node = Node.objects.get(id="node-a")
    assert (node.last_seen > old, node.state, node.unreachable_since) == (True, "ready", None)
    assert REGISTRY.get_sample_value("llmgw_telemetry_cache_errors_total", {"op": "put"}) == before + 1
    assert REGISTRY.get_sample_value("llmgw_telemetry_cache_errors_total", {"op": "get"}) >= 1
    # Readers see "not reported", not an error; /metrics says how many were skipped.
    assert telemetry.get("node-a") is None and telemetry.get_many(["node-a"]) == {}
    assert (
        f'llmgw_telemetry_cache_errors_total{{op="put"}} {before + 1}'
        in b"".join(client.get("/metrics").streaming_content).decode()
    )


def test_the_answers_name_the_gateway_that_serves_the_wakeup(client, join_token, settings):
    settings.LLMGW_WAKEUP_URL = "http://gw.example:8080"
    reg = post(client, "register", register_payload("node-w"), join_token)
    assert reg.status_code == 200 and reg.json()["wakeup_url"] == "http://gw.example:8080"
    hb = post(client, "heartbeat", heartbeat_payload("node-w"), reg.json()["credential"])
    assert hb.status_code == 200 and hb.json()["wakeup_url"] == "http://gw.example:8080"
    settings.LLMGW_WAKEUP_URL = ""
    hb = post(client, "heartbeat", heartbeat_payload("node-w"), reg.json()["credential"])
    assert hb.status_code == 200 and hb.json()["wakeup_url"] is None


def test_the_answers_name_the_gateway_that_takes_leases(client, join_token, settings):
    settings.LLMGW_LEASE_URL = "http://gw.example:8080/api/v1/agent/lease"
    reg = post(client, "register", register_payload("node-w"), join_token)
    assert reg.status_code == 200 and reg.json()["lease_url"] == "http://gw.example:8080/api/v1/agent/lease"
    hb = post(client, "heartbeat", heartbeat_payload("node-w"), reg.json()["credential"])
    assert hb.status_code == 200 and hb.json()["lease_url"] == "http://gw.example:8080/api/v1/agent/lease"
    settings.LLMGW_LEASE_URL = ""
    hb = post(client, "heartbeat", heartbeat_payload("node-w"), reg.json()["credential"])
    assert hb.status_code == 200 and hb.json()["lease_url"] is None


def test_a_status_that_waited_for_a_thread_is_dated_when_it_arrived_not_read_as_clock_skew(client, joined):
    # The web's front stamps when it had the whole request (llmgw/front.py RECEIVED_AT); a routine
    # status then waits behind the others. Its agent's clock is read against the arrival.
    import time

    from inventory import doctor_view, telemetry
    from llmgw.front import RECEIVED_AT

    sent = time.time() - 6.0  # the agent built it, and the front had it, six seconds before it is handled
    resp = post(client, "heartbeat", heartbeat_payload(at=sent), joined, **{RECEIVED_AT: sent + 0.01})
    assert resp.status_code == 200, resp.content
    entry = telemetry.get("node-a")
    assert (round(entry["at"] - sent, 2), doctor_view.skew(entry)) == (0.01, None)
    # Without the stamp (a server without the front) the handling time is all there is: six seconds behind.
    resp = post(client, "heartbeat", heartbeat_payload(at=time.time() - 6.0), joined)
    finding, fails = doctor_view.skew(telemetry.get("node-a"))
    assert (finding.startswith("agent clock behind by 6."), fails) == (True, False)
