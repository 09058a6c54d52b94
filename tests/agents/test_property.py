"""Random and mutated bodies at every agent endpoint: never a 5xx, never a partial write."""

from __future__ import annotations

import copy
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agents.models import JoinToken, NodeCredential
from inventory.models import (
    GPU,
    Command,
    EngineInstall,
    FabricAttachment,
    FabricScan,
    Node,
    NodeEvent,
    SMChange,
    Storage,
)
from placement.models import PlacementEvent, Shard
from tests.agents.conftest import heartbeat_payload, post
from tests.factories import register_payload

pytestmark = pytest.mark.django_db

# The scan command the valid scan upload answers (re-armed before each example).
SCAN_COMMAND = "00000000-0000-0000-0000-00000000005c"

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=300),
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=20), children, max_size=5),
    max_leaves=20,
)

VALID = {
    "register": register_payload(
        "node-a",
        gpus=2,
        running_shards=[{"replica_id": "r1", "shard_id": "00000000-0000-0000-0000-000000000001", "state": "ready"}],
        engine_installs=[{"engine": "vllm", "state": "ready"}],
        storage=[{"path": "/models", "free_bytes": 1, "total_bytes": 2}],
        imex={"state": "UP", "channels": 1},
    ),
    "heartbeat": heartbeat_payload(
        at=1.0,
        shards=[{"shard_id": "00000000-0000-0000-0000-000000000001", "state": "ready"}],
        gpu_fabrics=[{"index": 0, "fabric": {"state": "Completed", "status": "Success", "cluster_uuid": "c"}}],
        engine_installs=[{"engine": "vllm", "state": "ready"}],
        imex={"state": "UP", "channels": 1},
    ),
    "scans": {
        "node_id": "node-a",
        "command_id": SCAN_COMMAND,
        "key": "sm:0x1",
        "hca": "mlx5_0",
        "port": 1,
        "output": "text",
        "took_s": 1.0,
    },
    "rotate": {"node_id": "node-a"},
}


def paths(value, prefix=()):
    """Every path into a JSON document."""
    yield prefix
    if isinstance(value, dict):
        for k, v in value.items():
            yield from paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from paths(v, (*prefix, i))


@st.composite
def mutated(draw, endpoint):
    doc = copy.deepcopy(VALID[endpoint])
    for _ in range(draw(st.integers(min_value=1, max_value=3))):
        all_paths = [p for p in paths(doc) if p]
        if not all_paths:
            break
        target = draw(st.sampled_from(all_paths))
        parent = doc
        for step in target[:-1]:
            parent = parent[step]
        action = draw(st.sampled_from(["replace", "delete", "grow", "nul"]))
        if action == "nul" and isinstance(parent[target[-1]], str):
            # PostgreSQL stores no NUL: it must be a 400, never a 500 halfway through.
            parent[target[-1]] += "\x00"
        elif action == "delete":
            del parent[target[-1]]
        elif action == "grow" and isinstance(parent[target[-1]], str):
            parent[target[-1]] = parent[target[-1]] * draw(st.integers(min_value=2, max_value=300))
        else:
            parent[target[-1]] = draw(json_values)
    return doc


def snapshot() -> tuple:
    counts = tuple(
        m.objects.count()
        for m in (
            Node,
            GPU,
            NodeEvent,
            Command,
            Shard,
            PlacementEvent,
            EngineInstall,
            FabricScan,
            SMChange,
            FabricAttachment,
            Storage,
        )
    )
    node = Node.objects.filter(id="node-a").values().first()
    return (
        counts,
        node,
        list(NodeCredential.objects.values_list("token_hash", "previous_hash")),
        list(JoinToken.objects.values_list("uses", flat=True)),
        list(Shard.objects.values_list("state", "reason")),
    )


def check(client, endpoint, body, token):
    before = snapshot()
    data = body if isinstance(body, bytes) else json.dumps(body)
    resp = post(client, endpoint, data, token)
    assert resp.status_code < 500
    if resp.status_code != 200:
        assert resp.status_code in (400, 401, 403, 409, 413, 415)
        assert snapshot() == before, (endpoint, resp.status_code, resp.content[:300])
        assert resp.json()["detail"]


HYPOTHESIS = settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)


@pytest.mark.parametrize("endpoint", ["register", "heartbeat", "scans", "rotate"])
@HYPOTHESIS
@given(data=st.data())
def test_mutated_payloads(client, joined, endpoint, data, now):
    if endpoint == "scans":
        Command.objects.update_or_create(
            id=SCAN_COMMAND,
            defaults={
                "node_id": "node-a",
                "kind": "scan_fabric",
                "payload": {"key": "sm:0x1", "hca": "mlx5_0", "port": 1},
                "created_at": now,
                "acked_at": None,
            },
        )
    body = data.draw(mutated(endpoint))
    check(client, endpoint, body, joined)


@pytest.mark.parametrize("endpoint", ["register", "heartbeat", "scans"])
@HYPOTHESIS
@given(body=json_values | st.binary(max_size=200))
def test_random_payloads(client, joined, endpoint, body):
    check(client, endpoint, body, joined)


@HYPOTHESIS
@given(data=st.data())
def test_mutated_registrations_with_a_join_token(client, join_token, data):
    body = data.draw(mutated("register"))
    check(client, "register", body, join_token)
