"""Prometheus HTTP service discovery: exact documents, and a fixed number of queries at any fleet size."""

from __future__ import annotations

import datetime as dt
import uuid

import pytest
from django.urls import reverse

from inventory.models import Node, NodeState
from placement.models import Deployment, EngineProfile, Replica, ReplicaState, Shard
from tests.factories import gpu_payload, make_node

pytestmark = pytest.mark.django_db

DOMAIN = "8f1e7d33-9a0b-4c2d-8e5f-112233445566"
QUERIES = 3  # fabric attachments, nodes, ready replicas' leaders


def _nvl_gpus() -> list[dict]:
    fabric = {"state": "Completed", "status": "Success", "cluster_uuid": DOMAIN, "clique_id": "1"}
    return [gpu_payload(i, fabric=fabric) for i in range(4)]


def _replica(profile: EngineProfile, name: str, node: Node, *, state: str, port: int, now: dt.datetime) -> Replica:
    dep = Deployment.objects.create(name=name, served_model=name, profile=profile, replicas=1)
    r = Replica.objects.create(
        id=uuid.UUID(int=port),
        deployment=dep,
        state=state,
        endpoint=f"http://{node.mgmt_addr}:{port}",
        created_at=now,
        updated_at=now,
    )
    Shard.objects.create(replica=r, node=node, rank=0, http_port=port, state="ready", created_at=now, updated_at=now)
    return r


@pytest.fixture
def fleet(now):
    fabrics = [{"name": "ib-a", "hcas": ["mlx5_0"], "rate_gbps": 400}, {"name": "ib-b", "hcas": ["mlx5_1"]}]
    a = make_node(
        "gpu-a", now=now, gpus=_nvl_gpus(), mgmt_addr="10.0.0.1", metrics_addr="10.0.0.1:9400", fabrics=fabrics
    )
    b = make_node("gpu-b", now=now, gpus=2, mgmt_addr="10.0.0.2", metrics_addr="10.0.0.2:9400")
    # An agent too old to report a metrics address is not a target.
    make_node("gpu-old", now=now, gpus=2, mgmt_addr="10.0.0.3")
    Node.objects.filter(id="gpu-b").update(state=NodeState.CORDONED)
    profile = EngineProfile.objects.create(name="vllm-4", engine="vllm", gpus_per_node=4)
    _replica(profile, "chat", a, state=ReplicaState.READY, port=8001, now=now)
    _replica(profile, "code", b, state=ReplicaState.STARTING, port=8002, now=now)
    return a, b


AGENTS = [
    {
        "targets": ["10.0.0.1:9400"],
        "labels": {
            "job_kind": "agent",
            "node": "gpu-a",
            "fabrics": "ib-a,ib-b",
            "nvlink_domain": f"{DOMAIN}/1",  # cluster UUID / clique
            "state": "ready",
        },
    },
    {
        "targets": ["10.0.0.2:9400"],
        "labels": {"job_kind": "agent", "node": "gpu-b", "fabrics": "", "nvlink_domain": "", "state": "cordoned"},
    },
]
ENGINES = [
    {
        "targets": ["10.0.0.1:8001"],
        "labels": {
            "job_kind": "engine",
            "deployment": "chat",
            "replica": str(uuid.UUID(int=8001)),
            "engine": "vllm",
            "node": "gpu-a",
        },
    }
]


def test_the_document_lists_every_agent_and_every_ready_engine_with_their_labels(client, fleet):
    url = reverse("prometheus-targets")
    r = client.get(url)
    assert r.status_code == 200
    assert r["Content-Type"] == "application/json"
    assert r.json() == AGENTS + ENGINES
    assert client.get(url, {"kind": "agent"}).json() == AGENTS
    assert client.get(url, {"kind": "engine"}).json() == ENGINES


def test_an_unknown_kind_is_a_400_naming_the_field(client, fleet):
    r = client.get(reverse("prometheus-targets"), {"kind": "gpu"})
    assert r.status_code == 400
    assert r.json() == {"kind": ["must be one of agent, engine, not 'gpu'"]}


def test_a_registration_without_a_metrics_address_clears_the_old_one(now, fleet):
    make_node("gpu-a", now=now, gpus=2, mgmt_addr="10.0.0.1")
    assert Node.objects.get(id="gpu-a").metrics_addr == ""


@pytest.mark.parametrize("count", [3, 60])
def test_the_query_count_does_not_grow_with_the_fleet(client, now, django_assert_num_queries, count):
    profile = EngineProfile.objects.create(name="echo-1", engine="echo", gpus_per_node=1)
    for i in range(count):
        fabrics = [{"name": f"ib-{i % 2}", "hcas": ["mlx5_0"]}]
        node = make_node(
            f"n{i:03d}", now=now, gpus=1, mgmt_addr=f"10.1.0.{i}", metrics_addr=f"10.1.0.{i}:9400", fabrics=fabrics
        )
        _replica(profile, f"d{i}", node, state=ReplicaState.READY, port=9000 + i, now=now)
    with django_assert_num_queries(QUERIES):
        doc = client.get(reverse("prometheus-targets")).json()
    assert len(doc) == 2 * count
    assert doc[count - 1]["labels"]["fabrics"] == f"ib-{(count - 1) % 2}"


def test_the_targets_are_guarded_as_the_metrics_are(client, settings):
    # They name every node and engine endpoint: a scraper's token or address, or a viewer of nodes.
    settings.LLMGW_METRICS_TOKEN, settings.LLMGW_METRICS_ALLOW = "scrape-secret", []
    refused = client.get("/api/v1/prometheus/targets")
    assert (refused.status_code, refused["WWW-Authenticate"]) == (401, 'Bearer realm="llmgw-metrics"')
    assert client.get("/api/v1/prometheus/targets", HTTP_AUTHORIZATION="Bearer wrong").status_code == 401
    ok = client.get("/api/v1/prometheus/targets", HTTP_AUTHORIZATION="Bearer scrape-secret")
    assert (ok.status_code, ok.json()) == (200, [])
