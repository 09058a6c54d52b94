"""The inventory REST API: reads, filters, search, actions, labels, NVLink, and who may do what."""

import logging
import uuid

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from inventory import operations
from inventory.allocation import allocate
from inventory.models import Node, NodeEvent
from inventory.nodes import change_state
from tests.factories import gpu_payload, make_node
from tests.inventory.cockpit_fixtures import CLUSTER, nvlink_cluster, replica_on

pytestmark = pytest.mark.django_db


def client_for(user=None) -> APIClient:
    c = APIClient()
    if user is not None:
        c.force_authenticate(user)
    return c


@pytest.fixture
def cluster(now):
    a = make_node(
        "node-a",
        now=now,
        labels={"rack": "r1"},
        fabrics=[{"name": "ib-a", "hcas": ["mlx5_0"], "rate_gbps": 400}],
    )
    b = make_node(
        "node-b.example",
        now=now,
        gpus=[gpu_payload(0, name="NVIDIA A100-SXM4-40GB", memory_total_mb=40960, uuid="GPU-beef")],
        labels={"rack": "r2"},
    )
    allocate(node_id="node-a", replica_id=uuid.uuid4(), shard_id=uuid.uuid4(), gpu_indices=[0, 1, 2])
    return a, b


def ids(resp):
    return [n["id"] for n in resp.json()["results"]]


def test_node_list_shape(cluster, operator):
    resp = client_for(operator).get("/api/v1/nodes/")
    assert resp.status_code == 200
    body = resp.json()
    assert body["count"] == 2
    a = body["results"][0]
    assert (a["id"], a["state"], a["reachable"], a["gpus_total"], a["gpus_free"]) == ("node-a", "ready", True, 8, 5)
    assert a["gpu_classes"] == ["H100-80GB"]
    assert a["fabrics"] == [{"name": "ib-a", "hcas": ["mlx5_0"], "rate_gbps": 400}]
    assert (a["agent_labels"], a["operator_labels"], a["effective_labels"]) == ({"rack": "r1"}, {}, {"rack": "r1"})
    assert (a["nvlink_domain"], a["imex_up"]) == ("", False)
    assert a["gpus"][0]["uuid"] == "GPU-00000000-0000-0000-0000-000000000000"


def test_node_list_query_count(cluster, operator, django_assert_num_queries):
    for i in range(5):
        make_node(f"extra-{i}", now=cluster[0].registered_at, gpus=4)
    c = client_for(operator)
    c.get("/api/v1/nodes/")  # the user's permissions are read once, then cached on it
    # count, page, then one query each for GPUs, fabrics and allocated GPUs, however many nodes
    with django_assert_num_queries(5):
        resp = c.get("/api/v1/nodes/")
    assert resp.json()["count"] == 7


def test_gpu_list_query_count(cluster, operator, django_assert_num_queries):
    c = client_for(operator)
    c.get("/api/v1/gpus/")
    with django_assert_num_queries(2):
        resp = c.get("/api/v1/gpus/")
    assert resp.json()["count"] == 9


def test_nvlink_query_count(now, operator, django_assert_num_queries):
    nvlink_cluster(now)
    c = client_for(operator)
    c.get("/api/v1/nvlink")
    with django_assert_num_queries(2):
        resp = c.get("/api/v1/nvlink")
    assert len(resp.json()[0]["trays"]) == 3


def test_node_detail_accepts_dotted_ids(cluster, operator):
    resp = client_for(operator).get("/api/v1/nodes/node-b.example/")
    assert resp.status_code == 200
    assert resp.json()["gpu_classes"] == ["A100-40GB"]


@pytest.mark.parametrize(
    ("query", "expected"),
    [
        ("state=ready", ["node-a", "node-b.example"]),
        ("state=cordoned", []),
        ("gpu_class=A100-40GB", ["node-b.example"]),
        ("fabric=ib-a", ["node-a"]),
        ("label=rack=r2", ["node-b.example"]),
        ("label=rack", ["node-a", "node-b.example"]),
        ("search=GPU-beef", ["node-b.example"]),
        ("search=node-a.cluster", ["node-a"]),
    ],
)
def test_node_filters_and_search(cluster, operator, query, expected):
    resp = client_for(operator).get(f"/api/v1/nodes/?{query}")
    assert resp.status_code == 200
    assert ids(resp) == expected


def test_nvlink_domain_filter(now, operator):
    nvlink_cluster(now)
    resp = client_for(operator).get(f"/api/v1/nodes/?nvlink_domain={CLUSTER}/7")
    assert ids(resp) == ["tray-degraded", "tray-joined"]


def test_bad_label_filter_names_the_field(cluster, operator):
    resp = client_for(operator).get("/api/v1/nodes/?label=bad key=x")
    assert resp.status_code == 400
    assert list(resp.json()) == ["label"]


def test_cordon_uncordon_through_the_api(cluster, operator):
    c = client_for(operator)
    resp = c.post("/api/v1/nodes/node-a/cordon/", {"reason": "bad fan"}, format="json")
    assert resp.status_code == 200
    assert resp.json()["node"]["state"] == "cordoned"
    ev = NodeEvent.objects.filter(node_id="node-a", kind="state").latest("id")
    assert (ev.actor_name, ev.message) == ("operator", "ready -> cordoned: bad fan")
    again = c.post("/api/v1/nodes/node-a/cordon/", {}, format="json")
    assert again.status_code == 409
    assert again.json() == {"state": ["node node-a: already cordoned"]}
    # Uncordoned through the API, which acts now: its agent is silent since the fixture's time.
    silent = c.post("/api/v1/nodes/node-a/uncordon/", {}, format="json")
    assert silent.status_code == 409
    assert silent.json()["state"][0].startswith("node node-a: its agent has sent no heartbeat for ")
    assert Node.objects.get(id="node-a").state == "cordoned"
    Node.objects.filter(id="node-a").update(last_seen=timezone.now())
    assert c.post("/api/v1/nodes/node-a/uncordon/", {}, format="json").json()["node"]["state"] == "ready"


def test_forget_a_node_through_the_api(cluster, operator, viewer, now):
    """DELETE forgets a node whose shards all ended; refused (409, saying what it holds) while one runs."""
    assert client_for().delete("/api/v1/nodes/node-b.example/").status_code == 401
    assert client_for(viewer).delete("/api/v1/nodes/node-b.example/").status_code == 403
    c = client_for(operator)
    live = replica_on("node-b.example", now=now, state="ready", gpus=(0,))
    refused = c.delete("/api/v1/nodes/node-b.example/")
    assert refused.status_code == 409
    assert refused.json() == {"node": ["node-b.example still holds 1 shard not stopped"]}
    assert c.delete("/api/v1/nodes/node-a/").json() == {"node": ["node-a still holds 1 allocation"]}
    assert c.post("/api/v1/nodes/node-b.example/drain/", {"reason": "retired"}, format="json").status_code == 200
    live.shards.update(state="stopped")  # its agent reported the engine ended
    assert c.delete("/api/v1/nodes/node-b.example/").status_code == 204
    assert not Node.objects.filter(id="node-b.example").exists()
    assert c.get("/api/v1/nodes/node-b.example/").status_code == 404
    kinds = list(NodeEvent.objects.filter(node_name="node-b.example").order_by("id").values_list("kind", "actor_name"))
    assert kinds[-1] == ("forgotten", "operator") and ("state", "operator") in kinds


def test_drain_lists_the_replicas_that_will_move(cluster, operator, now):
    replica = replica_on("node-a", now=now, deployment="llama")
    resp = client_for(operator).post("/api/v1/nodes/node-a/drain/", {}, format="json")
    assert resp.status_code == 200
    body = resp.json()
    assert body["node"]["state"] == "draining"
    assert body["replicas_to_move"] == [
        {
            "replica_id": str(replica.id),
            "deployment": "llama",
            "replica_state": "ready",
            "shards": ["rank 0 (ready, GPUs 0,1)"],
        }
    ]


def test_action_reason_is_validated(cluster, operator):
    resp = client_for(operator).post("/api/v1/nodes/node-a/drain/", {"reason": "x" * 501}, format="json")
    assert resp.status_code == 400
    assert list(resp.json()) == ["reason"]
    assert Node.objects.get(id="node-a").state == "ready"


def test_put_labels_replaces_and_patch_removes(cluster, operator):
    c = client_for(operator)
    resp = c.put("/api/v1/nodes/node-a/labels/", {"labels": {"rack": "r7", "pool": "batch"}}, format="json")
    assert resp.status_code == 200
    assert resp.json() == {
        "agent_labels": {"rack": "r1"},
        "operator_labels": {"rack": "r7", "pool": "batch"},
        "effective_labels": {"rack": "r7", "pool": "batch"},
    }
    resp = c.patch("/api/v1/nodes/node-a/labels/", {"labels": {"rack": None}}, format="json")
    assert resp.json()["effective_labels"] == {"rack": "r1", "pool": "batch"}
    events = NodeEvent.objects.filter(node_id="node-a", kind="labels").order_by("id")
    assert [(e.actor_name, e.data["to"]) for e in events] == [
        ("operator", {"rack": "r7", "pool": "batch"}),
        ("operator", {"pool": "batch"}),
    ]


@pytest.mark.parametrize(
    ("method", "body", "error"),
    [
        ("put", {"labels": {"bad key": "x"}}, {"labels": {"bad key": None}}),
        ("put", {"labels": {"rack": "x y"}}, {"labels": {"rack": None}}),
        ("put", {"labels": {"rack": None}}, {"labels": {"rack": ["null removes a label, only with PATCH"]}}),
        ("patch", {"labels": {"bad key": None}}, {"labels": {"bad key": [operations.KEY_RULE]}}),
        ("put", {"labels": "rack=r1"}, {"labels": None}),
        ("put", {}, {"labels": ["This field is required."]}),
    ],
)
def test_bad_labels_get_400_naming_the_field(cluster, operator, method, body, error):
    resp = getattr(client_for(operator), method)("/api/v1/nodes/node-a/labels/", body, format="json")
    assert resp.status_code == 400
    got = resp.json()
    assert list(got) == list(error)
    inner = error["labels"]
    if isinstance(inner, dict):
        assert list(got["labels"]) == list(inner)
        for k, v in inner.items():
            if v is not None:
                assert got["labels"][k] == v
    elif inner is not None:
        assert got["labels"] == inner
    assert Node.objects.get(id="node-a").operator_labels == {}


def test_gpu_list_filters(cluster, operator):
    resp = client_for(operator).get("/api/v1/gpus/?gpu_class=A100-40GB")
    assert [(g["node"], g["index"], g["healthy"]) for g in resp.json()["results"]] == [("node-b.example", 0, True)]
    resp = client_for(operator).get("/api/v1/gpus/?node=node-a")
    assert resp.json()["count"] == 8


def test_nvlink_endpoint(now, operator):
    nvlink_cluster(now)
    change_state("tray-joined", "cordoned", now=now)
    (rack,) = client_for(operator).get("/api/v1/nvlink").json()
    assert (rack["domain"], rack["cluster_uuid"], rack["clique"], rack["joined"]) == (f"{CLUSTER}/7", CLUSTER, "7", 1)
    trays = {t["node_id"]: t for t in rack["trays"]}
    assert trays["tray-degraded"]["state"] == "degraded"
    assert [c["state"] for c in trays["tray-degraded"]["cards"]] == ["joined", "degraded", "joined", "joined"]
    assert trays["tray-half"]["state"] == "out"
    assert trays["tray-half"]["reasons"] == [
        "GPU 2 not joined (In Progress, N/A)",
        "GPU 3 not joined (In Progress, N/A)",
    ]
    assert trays["tray-joined"]["reasons"] == ["node not ready (cordoned)"]


# --- the auth matrix ----------------------------------------------------------

READS = ["/api/v1/nodes/", "/api/v1/nodes/node-a/", "/api/v1/gpus/", "/api/v1/nvlink"]
ACTIONS = [
    ("post", "/api/v1/nodes/node-a/cordon/", {}),
    ("post", "/api/v1/nodes/node-a/uncordon/", {}),
    ("post", "/api/v1/nodes/node-a/drain/", {}),
    ("put", "/api/v1/nodes/node-a/labels/", {"labels": {"x": "y"}}),
    ("patch", "/api/v1/nodes/node-a/labels/", {"labels": {"x": "y"}}),
]


@pytest.mark.parametrize("url", READS)
def test_anonymous_cannot_read(cluster, url):
    resp = client_for().get(url)
    # 401 saying how to authenticate: an operator token.
    assert resp.status_code == 401
    assert resp["WWW-Authenticate"] == "Token"


@pytest.mark.parametrize("url", READS)
def test_viewer_and_operator_can_read(cluster, viewer, operator, url):
    assert client_for(viewer).get(url).status_code == 200
    assert client_for(operator).get(url).status_code == 200


@pytest.mark.parametrize(("method", "url", "body"), ACTIONS)
def test_anonymous_and_viewer_cannot_act(cluster, viewer, method, url, body):
    assert getattr(client_for(), method)(url, body, format="json").status_code == 401
    assert getattr(client_for(viewer), method)(url, body, format="json").status_code == 403
    node = Node.objects.get(id="node-a")
    assert (node.state, node.operator_labels) == ("ready", {})
    assert not NodeEvent.objects.filter(node_id="node-a", kind__in=["state", "labels"]).exists()


def test_a_user_with_only_cordon_may_not_drain(cluster, django_user_model):
    from django.contrib.auth.models import Permission

    user = django_user_model.objects.create_user("cordoner")
    user.user_permissions.set(Permission.objects.filter(codename__in=["view_node", "cordon_node"]))
    c = client_for(user)
    assert c.post("/api/v1/nodes/node-a/cordon/", {}, format="json").status_code == 200
    assert c.post("/api/v1/nodes/node-a/drain/", {}, format="json").status_code == 403


def test_an_agent_credential_is_no_operator(cluster):
    # A node's agent authenticates with a bearer credential the operator API does not accept.
    c = APIClient()
    c.credentials(HTTP_AUTHORIZATION="Bearer not-an-operator-token")
    assert c.get("/api/v1/nodes/").status_code == 401
    assert c.post("/api/v1/nodes/node-a/cordon/", {}, format="json").status_code == 401


def test_gpu_api_carries_the_fabric_health_summary(operator, now):
    cards = [
        gpu_payload(
            0,
            fabric={
                "state": "Completed",
                "status": "Success",
                "cluster_uuid": CLUSTER,
                "clique_id": "7",
                "bandwidth": "Full",
                "health": "Unhealthy",
            },
        )
    ]
    make_node("sick", now=now, gpus=cards)
    [gpu] = client_for(operator).get("/api/v1/gpus/?search=sick").json()["results"]
    assert (gpu["fabric_health"], gpu["nvlink_domain"]) == ("Unhealthy", f"{CLUSTER}/7")


def test_a_drain_is_one_info_line_naming_who_and_why(cluster, operator, caplog, django_capture_on_commit_callbacks):
    with caplog.at_level(logging.INFO), django_capture_on_commit_callbacks(execute=True):
        resp = client_for(operator).post("/api/v1/nodes/node-a/drain/", {"reason": "swap a PSU"}, format="json")
    assert resp.status_code == 200
    assert [(r.name, r.levelname, r.getMessage()) for r in caplog.records] == [
        ("inventory.nodes", "INFO", "node node-a: state: ready -> draining: swap a PSU (by operator)")
    ]
