"""Placement's API: auth matrix, filters, pagination, query counts, the dry run."""

from __future__ import annotations

import datetime as dt
import json
import re

import pytest
from django.urls import reverse
from django.utils import timezone
from rest_framework.test import APIClient

import llmgw_wire as wire
from placement import agent_sync, explain, planner
from placement.models import Deployment, EngineProfile, Hold, PlacementEvent, PowerBudget, Replica, Shard
from placement.reconciler import reconcile
from placement.serializers import DryRunOut
from tests.factories import make_node

pytestmark = pytest.mark.django_db


@pytest.fixture
def profile():
    return EngineProfile.objects.create(name="echo-4", engine="echo", gpus_per_node=4)


@pytest.fixture
def dep(profile):
    return Deployment.objects.create(name="chat", served_model="chat", profile=profile, replicas=1)


def client(user=None) -> APIClient:
    c = APIClient()
    if user is not None:
        c.force_authenticate(user)
    return c


LISTS = ["profiles", "deployments", "replicas", "shards", "holds", "power-budgets", "placement-events"]


@pytest.mark.parametrize("name", LISTS)
def test_anonymous_is_refused(name):
    assert client().get(f"/api/v1/{name}/").status_code in (401, 403)
    assert client().post("/api/v1/placement/dry-run/", {}, format="json").status_code in (401, 403)


@pytest.mark.parametrize("name", LISTS)
def test_viewer_reads(name, viewer):
    r = client(viewer).get(f"/api/v1/{name}/")
    assert r.status_code == 200
    assert r.json()["count"] == 0


def test_viewer_cannot_write(viewer, dep):
    c = client(viewer)
    assert c.post("/api/v1/profiles/", {"name": "x", "engine": "echo"}, format="json").status_code == 403
    assert c.post(f"/api/v1/deployments/{dep.id}/scale/", {"replicas": 3}, format="json").status_code == 403
    assert c.post(f"/api/v1/deployments/{dep.id}/pause/").status_code == 403
    assert c.post("/api/v1/holds/", {"scope": "label", "label_key": "rack"}, format="json").status_code == 403
    assert c.delete(f"/api/v1/deployments/{dep.id}/").status_code == 403
    assert Deployment.objects.get().replicas == 1


def test_operator_creates_profile_and_deployment(operator, django_capture_on_commit_callbacks):
    c = client(operator)
    r = c.post(
        "/api/v1/profiles/",
        {"name": "vllm-8", "engine": "vllm", "tp": 8, "gpus_per_node": 8, "args": ["--max-model-len", "8192"]},
        format="json",
    )
    assert r.status_code == 201, r.json()
    prof = r.json()
    assert prof["fingerprint"] == EngineProfile.objects.get(name="vllm-8").fingerprint()
    with django_capture_on_commit_callbacks() as callbacks:
        r = c.post(
            "/api/v1/deployments/",
            {
                "name": "big",
                "served_model": "big",
                "profile": prof["id"],
                "replicas": 2,
                "node_selector": {"pool": "a"},
            },
            format="json",
        )
    assert r.status_code == 201, r.json()
    assert r.json()["replicas"] == 2 and r.json()["ready_replicas"] == 0
    # A reconcile queued on commit (beside the change's log line, also written on commit).
    assert sum("queue_reconcile" in repr(c) for c in callbacks) == 1
    ev = PlacementEvent.objects.get(kind="changed")
    assert (ev.actor_name, ev.deployment.name) == ("operator", "big")


def test_bad_input_names_the_field(operator, profile):
    c = client(operator)
    r = c.post("/api/v1/profiles/", {"name": "x", "engine": "echo", "args": "--a --b"}, format="json")
    assert r.status_code == 400 and "args" in r.json()
    r = c.post(
        "/api/v1/deployments/",
        {"name": "d", "served_model": "d", "profile": profile.id, "policy": "random"},
        format="json",
    )
    assert r.status_code == 400 and "policy" in r.json()
    r = c.post("/api/v1/holds/", {"scope": "fabric"}, format="json")
    assert r.status_code == 400 and r.json() == {"fabric": ["a fabric hold must name its fabric"]}
    assert not Hold.objects.exists()


def test_a_llamacpp_served_name_with_a_comma_is_refused_naming_the_field(operator):
    c = client(operator)
    body = {"name": "qwen", "engine": "llamacpp", "served_model_name": "qwen,coder", "model_path": "/m.gguf"}
    r = c.post("/api/v1/profiles/", body, format="json")
    assert r.status_code == 400
    assert r.json() == {"served_model_name": ["llama.cpp splits its served name on commas: choose a name without one"]}
    # Without a served name the profile's name is served: the same rule.
    r = c.post("/api/v1/profiles/", {"name": "a,b", "engine": "llamacpp"}, format="json")
    assert (r.status_code, list(r.json())) == (400, ["name"])
    # vLLM takes the name whole.
    r = c.post("/api/v1/profiles/", {**body, "engine": "vllm"}, format="json")
    assert r.status_code == 201
    assert not EngineProfile.objects.filter(engine="llamacpp").exists()


def test_scale_pause_resume(operator, dep, now):
    c = client(operator)
    r = c.post(f"/api/v1/deployments/{dep.id}/scale/", {"replicas": 3}, format="json")
    assert r.status_code == 200 and r.json()["replicas"] == 3
    assert c.post(f"/api/v1/deployments/{dep.id}/scale/", {"replicas": -1}, format="json").status_code == 400
    assert c.post(f"/api/v1/deployments/{dep.id}/pause/").json()["paused"] is True
    assert c.post(f"/api/v1/deployments/{dep.id}/resume/").json()["paused"] is False
    kinds = list(PlacementEvent.objects.filter(deployment=dep).order_by("id").values_list("kind", "reason"))
    assert kinds == [("scaled", "replicas 1 -> 3"), ("paused", ""), ("resumed", "")]


def test_holds_and_budgets(operator):
    c = client(operator)
    r = c.post("/api/v1/holds/", {"scope": "label", "label_key": "rack", "label_value": "r12"}, format="json")
    assert r.status_code == 201 and r.json()["created_by"] == "operator"
    assert c.delete(f"/api/v1/holds/{r.json()['id']}/").status_code == 204
    r = c.post("/api/v1/power-budgets/", {"label_key": "rack", "label_value": "r12", "budget_w": 40000}, format="json")
    assert r.status_code == 201
    assert PowerBudget.objects.get().budget_w == 40000


def _populate(now, profile, n: int) -> None:
    for i in range(n):
        make_node(f"n{len(Deployment.objects.all())}-{i}", now=now)
        Deployment.objects.create(name=f"d{Deployment.objects.count()}", served_model="m", profile=profile, replicas=1)
    reconcile(now=now)


@pytest.mark.parametrize(
    ("path", "queries"),
    [("deployments", 2), ("replicas", 3), ("shards", 2), ("profiles", 2), ("placement-events", 2)],
)
def test_list_query_counts_do_not_grow(path, queries, viewer, now, profile, django_assert_num_queries):
    c = client(viewer)
    _populate(now, profile, 2)
    c.get(f"/api/v1/{path}/")  # the user's permissions, read once and cached
    # The count and the page (and the replicas' shards in one more).
    with django_assert_num_queries(queries):
        assert c.get(f"/api/v1/{path}/").status_code == 200
    _populate(now, profile, 5)
    with django_assert_num_queries(queries):
        r = c.get(f"/api/v1/{path}/")
    if path == "profiles":
        EngineProfile.objects.bulk_create([EngineProfile(name=f"p{i}", engine="echo") for i in range(5)])
        with django_assert_num_queries(queries):
            r = c.get(f"/api/v1/{path}/")
    assert r.json()["count"] >= 6


def test_replica_filters_and_pagination(viewer, now, profile):
    _populate(now, profile, 3)
    c = client(viewer)
    r = c.get("/api/v1/replicas/", {"state": "starting", "limit": 2})
    body = r.json()
    assert body["count"] == 3 and len(body["results"]) == 2 and body["next"]
    node = "n0-0"  # binpack fills the first node (ties by id) before the next
    r = c.get("/api/v1/replicas/", {"shards__node": node})
    assert [x["shards"][0]["node"] for x in r.json()["results"]] == [node, node]
    r = c.get("/api/v1/shards/", {"node": node})
    assert r.json()["count"] == 2
    rep = Replica.objects.filter(shards__node_id=node).first()
    events = c.get(f"/api/v1/replicas/{rep.id}/events/").json()["results"]
    assert [(e["kind"], e["from_state"], e["to_state"]) for e in events] == [
        ("state", "pending", "starting"),
        ("created", "", "pending"),
    ]


def test_dry_run_refuses_a_ready_node_whose_lease_expired(viewer, profile, settings):
    settings.LLMGW_UNREACHABLE_AFTER = 30
    make_node("a", now=timezone.now() - dt.timedelta(seconds=120))
    r = client(viewer).post("/api/v1/placement/dry-run/", {"profile": profile.id, "replicas": 1}, format="json")
    (plan,) = r.json()["plans"]
    assert not plan["ok"]
    (why,) = plan["summary"]
    assert (why["nodes"], why["examples"]) == (1, ["a"])
    assert re.fullmatch(r"no heartbeat for 12\d s: lease expired", why["reason"])


def test_dry_run_is_the_planner_over_a_fresh_snapshot(viewer, profile):
    # Heard from just now: the dry run, like the reconciler, refuses a node whose lease expired.
    make_node("a", now=timezone.now())
    make_node("b", now=timezone.now(), gpus=2)
    r = client(viewer).post("/api/v1/placement/dry-run/", {"profile": profile.id, "replicas": 3}, format="json")
    assert r.status_code == 200
    body = r.json()
    assert body["placed"] == 2
    first, second, third = body["plans"]
    assert first["shards"][0]["node"] == "a"
    assert (first["summary"], first["fits"]) == (
        [{"reason": "2 free GPUs, needs 4", "nodes": 1, "examples": ["b"]}],
        [],
    )
    assert second["shards"][0]["gpu_indices"] == [4, 5, 6, 7]
    assert third == {
        "ok": False,
        "reason": "0 free GPUs, needs 4 (a); 2 free GPUs, needs 4 (b)",
        "summary": [
            {"reason": "0 free GPUs, needs 4", "nodes": 1, "examples": ["a"]},
            {"reason": "2 free GPUs, needs 4", "nodes": 1, "examples": ["b"]},
        ],
        "fits": [],
    }
    assert not Replica.objects.exists()  # nothing written


@pytest.mark.parametrize("path", ["/api/v1/placement/dry-run/", "/api/v1/placement/dry-run"])
def test_dry_run_answers_with_and_without_the_trailing_slash(viewer, profile, path):
    # Heard from just now: the dry run refuses a node whose lease expired.
    make_node("a", now=timezone.now())
    r = client(viewer).post(path, {"profile": profile.id, "replicas": 1}, format="json")
    assert r.status_code == 200
    assert r.json()["placed"] == 1 and r.json()["plans"][0]["shards"][0]["node"] == "a"
    assert reverse("placement-dry-run") == "/api/v1/placement/dry-run/"


def test_dry_run_needs_a_profile(viewer):
    r = client(viewer).post("/api/v1/placement/dry-run/", {}, format="json")
    assert r.status_code == 400 and r.json() == {"profile": ["name a profile or a deployment"]}


def test_dry_run_refuses_an_unknown_explain(viewer, profile):
    r = client(viewer).post("/api/v1/placement/dry-run/", {"profile": profile.id, "explain": "every"}, format="json")
    assert r.status_code == 400 and r.json() == {"explain": ['"every" is not a valid choice.']}


def test_dry_run_summarises_the_reasons_and_bounds_the_nodes_that_fit(viewer, profile):
    now = timezone.now()
    for i in range(24):
        make_node(f"n{i:02d}", now=now)
    for i in range(4):
        make_node(f"small{i}", now=now, gpus=2)
    c = client(viewer)
    r = c.post("/api/v1/placement/dry-run/", {"profile": profile.id}, format="json")
    (plan,) = r.json()["plans"]
    # Binpack takes the first of the equally full nodes; 23 others could have taken it, 20 are named.
    assert plan["shards"][0]["node"] == "n00"
    assert plan["summary"] == [
        {"reason": "fits; binpack chose n00", "nodes": 23, "examples": ["n01", "n02", "n03"]},
        {"reason": "2 free GPUs, needs 4", "nodes": 4, "examples": ["small0", "small1", "small2"]},
    ]
    assert plan["fits"] == [f"n{i:02d}" for i in range(1, 21)]
    assert "reasons" not in plan
    # Asked for, every node's reason comes too, beside the same summary.
    r = c.post("/api/v1/placement/dry-run/", {"profile": profile.id, "explain": "all"}, format="json")
    (every,) = r.json()["plans"]
    assert every["summary"] == plan["summary"] and every["fits"] == plan["fits"]
    assert len(every["reasons"]) == 27
    assert every["reasons"]["small3"] == "2 free GPUs, needs 4"
    assert every["reasons"]["n23"] == "fits; binpack chose n00"


def test_deleting_a_deployment_with_live_replicas_is_refused(operator, dep, now):
    make_node("a", now=now)
    reconcile(now=now)
    c = client(operator)
    r = c.delete(f"/api/v1/deployments/{dep.id}/")
    assert r.status_code == 409 and r.json() == {"replicas": ["1 replicas still live: scale to 0 first"]}
    c.post(f"/api/v1/deployments/{dep.id}/scale/", {"replicas": 0}, format="json")
    reconcile(now=now)  # told to stop: draining
    assert c.delete(f"/api/v1/deployments/{dep.id}/").status_code == 409
    Shard.objects.update(state="stopped")  # the agent reports it ended
    reconcile(now=now)
    assert c.delete(f"/api/v1/deployments/{dep.id}/").status_code == 204


def test_a_deployment_whose_replica_was_never_placed_is_deleted_at_once(operator, viewer, dep, now):
    """A pending replica holds no GPU, port or shard: it does not keep its deployment alive."""
    reconcile(now=now)  # no node: the replica stays pending
    (rep,) = Replica.objects.filter(deployment=dep)
    assert rep.state == "pending" and not Shard.objects.exists()
    assert client().delete(f"/api/v1/deployments/{dep.id}/").status_code == 401
    assert client(viewer).delete(f"/api/v1/deployments/{dep.id}/").status_code == 403
    r = client(operator).delete(f"/api/v1/deployments/{dep.id}/")
    assert r.status_code == 204, r.content
    assert not Deployment.objects.filter(id=dep.id).exists() and not Replica.objects.exists()
    gone = PlacementEvent.objects.get(kind="deleted")
    assert (gone.actor, gone.deployment_name) == (operator, "chat")
    assert gone.reason == "deleted: deployment chat (model chat, profile echo-4)"


def test_an_agent_credential_is_not_an_operator(client, settings):
    """A node's credential talks to the agent endpoints only: placement refuses it."""
    from tests.agents.conftest import JOIN, post
    from tests.factories import register_payload

    settings.LLMGW_JOIN_TOKEN = JOIN
    cred = post(client, "register", register_payload("node-a"), JOIN).json()["credential"]
    auth = {"HTTP_AUTHORIZATION": f"Bearer {cred}"}
    for name in LISTS:
        assert client.get(f"/api/v1/{name}/", **auth).status_code in (401, 403)
    r = client.post("/api/v1/placement/dry-run/", {}, content_type="application/json", **auth)
    assert r.status_code in (401, 403)


def test_dry_run_body_exactly(viewer, profile):
    make_node("a", now=timezone.now(), gpus=4)
    make_node("b", now=timezone.now(), gpus=2)
    r = client(viewer).post("/api/v1/placement/dry-run/", {"profile": profile.id, "replicas": 2}, format="json")
    shard = {
        "node": "a",
        "rank": 0,
        "gpu_indices": [0, 1, 2, 3],
        "hcas": [],
        "http_port": 18000,
        "power_w": 2800.0,
        "install_engine": False,
    }
    plan = {"ok": True, "nvlink_domain": "", "fabric": "", "fabric_name": "", "env": {}}
    b_short = {"reason": "2 free GPUs, needs 4", "nodes": 1, "examples": ["b"]}
    refusal = {
        "ok": False,
        "reason": "0 free GPUs, needs 4 (a); 2 free GPUs, needs 4 (b)",
        "summary": [{"reason": "0 free GPUs, needs 4", "nodes": 1, "examples": ["a"]}, b_short],
        "fits": [],
    }
    body = {"placed": 1, "plans": [{**plan, "shards": [shard], "summary": [b_short], "fits": []}, refusal]}
    assert r.content.decode() == json.dumps(body, separators=(",", ":"))
    asked = {"profile": profile.id, "replicas": 2, "explain": "all"}
    r = client(viewer).post("/api/v1/placement/dry-run/", asked, format="json")
    body["plans"][0]["reasons"] = {"b": "2 free GPUs, needs 4"}
    body["plans"][1]["reasons"] = {"a": "0 free GPUs, needs 4", "b": "2 free GPUs, needs 4"}
    assert r.content.decode() == json.dumps(body, separators=(",", ":"))


def test_dry_run_renders_every_part_of_a_plan():
    shard = planner.ShardPlan(
        node_id="a", rank=1, gpu_indices=(2, 3), hcas=("mlx5_0",), http_port=18002, power_w=1400.0, install_engine=True
    )
    result = planner.Plan(
        shards=(shard,),
        nvlink_domain="nvl:x",
        fabric="sm:0x1",
        fabric_name="ib-a",
        env={"NCCL_IB_HCA": "mlx5_0"},
        reasons={"b": "cordoned"},
    )
    assert DryRunOut({"placed": 1, "plans": [explain.shown(result, every=True)]}).data == {
        "placed": 1,
        "plans": [
            {
                "ok": True,
                "nvlink_domain": "nvl:x",
                "fabric": "sm:0x1",
                "fabric_name": "ib-a",
                "env": {"NCCL_IB_HCA": "mlx5_0"},
                "shards": [
                    {
                        "node": "a",
                        "rank": 1,
                        "gpu_indices": [2, 3],
                        "hcas": ["mlx5_0"],
                        "http_port": 18002,
                        "power_w": 1400.0,
                        "install_engine": True,
                    }
                ],
                "summary": [{"reason": "cordoned", "nodes": 1, "examples": ["b"]}],
                "fits": [],
                "reasons": {"b": "cordoned"},
            }
        ],
    }


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"power_w": -1}, "power_w"),
        ({"tp": 4097}, "tp"),
        ({"pp": 0}, "pp"),
        ({"gpus_per_node": 65}, "gpus_per_node"),
        ({"nodes": 1025}, "nodes"),
        ({"startup_timeout_s": 86_401}, "startup_timeout_s"),
        ({"startup_timeout_s": 0}, "startup_timeout_s"),
        ({"args": ["x" * 4097]}, "args"),
        ({"args": ["--a"] * 257}, "args"),
        ({"env": {"K" * 129: "v"}}, "env"),
        ({"env": {f"K{i}": "v" for i in range(257)}}, "env"),
        ({"env": {"K": "v" * 4097}}, "env"),
        ({"served_model_name": "m" * 129}, "served_model_name"),
    ],
)
def test_profile_input_has_the_wire_bounds(operator, change, field):
    r = client(operator).post("/api/v1/profiles/", {"name": "p", "engine": "echo", **change}, format="json")
    assert r.status_code == 400
    assert list(r.json()) == [field]
    assert not EngineProfile.objects.exists()


def test_profile_at_the_wire_bounds_becomes_a_valid_start_shard(operator):
    body = {
        "name": "p",
        "engine": "echo",
        "tp": 4096,
        "pp": 1024,
        "gpus_per_node": 64,
        "nodes": 1024,
        "startup_timeout_s": 86_400,
        "args": ["a" * 4096] * 256,
        "env": {f"{i:0128}": "v" * 4096 for i in range(256)},
    }
    r = client(operator).post("/api/v1/profiles/", body, format="json")
    assert r.status_code == 201, r.json()
    p = EngineProfile.objects.get()
    wire.EngineProfile(
        name=p.name,
        engine=p.engine,
        tp=p.tp,
        pp=p.pp,
        gpus_per_node=p.gpus_per_node,
        nodes=p.nodes,
        args=p.args,
        env=p.env,
    )
    wire.StartShard(
        replica_id="r",
        shard_id="s",
        http_port=8000,
        profile=wire.EngineProfile(engine="echo"),
        startup_timeout_s=p.startup_timeout_s,
    )


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"node_selector": {"bad key!": "x"}}, "node_selector"),
        ({"node_selector": {"rack": "v" * 64}}, "node_selector"),
        ({"node_selector": {f"k{i}": "v" for i in range(65)}}, "node_selector"),
        ({"replicas": 10_001}, "replicas"),
        ({"pool": "p" * 65}, "pool"),
    ],
)
def test_deployment_input_has_the_wire_bounds(operator, profile, body, field):
    base = {"name": "d", "served_model": "m", "profile": profile.id}
    r = client(operator).post("/api/v1/deployments/", {**base, **body}, format="json")
    assert r.status_code == 400
    assert list(r.json()) == [field]
    assert not Deployment.objects.exists()


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("holds", {"scope": "label", "label_key": "rack!", "label_value": "r1"}, "label_key"),
        ("holds", {"scope": "label", "label_key": "rack", "label_value": "r" * 64}, "label_value"),
        ("power-budgets", {"label_key": "rack", "label_value": "r1", "budget_w": -1}, "budget_w"),
        ("power-budgets", {"label_key": "rack", "label_value": "r1", "budget_w": 1e300}, "budget_w"),
        ("power-budgets", {"label_key": "-rack", "label_value": "r1", "budget_w": 1}, "label_key"),
    ],
)
def test_hold_and_budget_inputs_have_the_wire_bounds(operator, path, body, field):
    r = client(operator).post(f"/api/v1/{path}/", body, format="json")
    assert r.status_code == 400
    assert list(r.json()) == [field]
    assert not Hold.objects.exists() and not PowerBudget.objects.exists()


@pytest.mark.parametrize(
    ("body", "errors"),
    [
        (
            {"engine": "vllm", "tp": 8, "pp": 2, "nodes": 2, "gpus_per_node": 4},
            {
                "gpus_per_node": [
                    "vLLM runs tp x pp = 8 x 2 = 16 ranks, one per GPU, but nodes x gpus_per_node = 2 x 4 = 8"
                ]
            },
        ),
        (
            {"engine": "sglang", "tp": 3, "nodes": 2},
            {"nodes": ["SGLang spreads tp x pp = 3 ranks evenly over nodes; 2 nodes cannot"]},
        ),
        ({"engine": "llamacpp", "nodes": 2}, {"nodes": ["llama.cpp runs on one node; nodes is 2"]}),
    ],
)
def test_profile_parallelism_the_engine_cannot_run_is_a_400_naming_the_field(operator, body, errors):
    r = client(operator).post("/api/v1/profiles/", {"name": "p", **body}, format="json")
    assert (r.status_code, r.json()) == (400, errors)
    assert not EngineProfile.objects.exists()


def test_profile_parallelism_that_fits_and_engine_aliases(operator):
    c = client(operator)
    r = c.post(
        "/api/v1/profiles/",
        {"name": "a", "engine": "vllm", "tp": 8, "pp": 2, "nodes": 2, "gpus_per_node": 8},
        format="json",
    )
    assert r.status_code == 201, r.json()
    # Any name an engine goes by is stored as its canonical one.
    r = c.post("/api/v1/profiles/", {"name": "b", "engine": "llama-server", "model_path": "/m.gguf"}, format="json")
    assert (r.status_code, r.json()["engine"]) == (201, "llamacpp")
    r = c.post("/api/v1/profiles/", {"name": "c", "engine": "tgi"}, format="json")
    assert r.status_code == 400 and list(r.json()) == ["engine"]


def test_a_failed_shard_shows_its_cause_and_the_end_of_its_engines_output(viewer, dep, now):
    make_node("a", now=now)
    reconcile(now=now)
    shard = Shard.objects.get()
    tail = ["INFO serving with --api-key s3cret", "OSError: [Errno 98] Address already in use"]
    failed = wire.ShardStatus(
        shard_id=str(shard.id), state="failed", reason="the engine exited with code 1", exit_code=1, log_tail=tail
    )
    agent_sync.record_shard_states("a", [failed], now=now)
    cause = "the engine exited with code 1: OSError: [Errno 98] Address already in use"
    output = "INFO serving with --api-key ***\nOSError: [Errno 98] Address already in use"
    assert client().get(f"/api/v1/shards/{shard.id}/").status_code in (401, 403)
    c = client(viewer)
    body = c.get(f"/api/v1/shards/{shard.id}/").json()
    assert (body["state"], body["reason"], body["exit_code"], body["output_tail"]) == ("failed", cause, 1, output)
    (listed,) = c.get("/api/v1/shards/", {"state": "failed"}).json()["results"]
    assert listed["output_tail"] == output
    (inside,) = c.get(f"/api/v1/replicas/{shard.replica_id}/").json()["shards"]
    assert (inside["reason"], inside["output_tail"]) == (cause, output)
