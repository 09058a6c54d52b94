"""/metrics: llmgw's metrics parsed with prometheus_client's own parser, and the scrape's query count."""

from __future__ import annotations

import datetime as dt
import ipaddress
import uuid

import pytest
from django.core.cache import cache
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families

from inventory import doctor, doctor_refresh, telemetry
from inventory.models import GPU, AllocatedGPU, Allocation, LivenessClock, Node, NodeState
from inventory.nodes import change_state
from placement.models import Deployment, EngineProfile, Replica, ReplicaState, Shard
from tests.factories import gpu_payload, make_node
from tests.inventory.ibports import ib_port, put

pytestmark = pytest.mark.django_db

CLUSTER = "c1a5e7e2-7c9b-4d1a-9f1e-2b3c4d5e6f70"
JOINED = {"state": "Completed", "status": "Success", "cluster_uuid": CLUSTER, "clique_id": "7", "bandwidth": "Full"}


def scrape(client) -> dict[str, dict[tuple, float]]:
    """llmgw's samples by name, each keyed by its sorted label pairs."""
    resp = client.get("/metrics")
    assert resp.status_code == 200
    out: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(b"".join(resp.streaming_content).decode()):
        for s in family.samples:
            # prometheus_client's creation-time series of a counter is not a metric of ours.
            if s.name.startswith("llmgw_") and not s.name.endswith("_created"):
                out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def lbl(**kw) -> tuple:
    return tuple(sorted(kw.items()))


@pytest.fixture
def cluster():
    now = timezone.now().replace(microsecond=0)
    seen = now - dt.timedelta(seconds=30)
    gpus = [gpu_payload(0, fabric=JOINED), gpu_payload(1, fabric={**JOINED, "state": "In Progress"})]
    make_node("tray-1", now=seen, gpus=gpus, imex={"state": "UP", "channels": 1})
    make_node("pcie-1", now=seen, gpus=1)
    change_state("pcie-1", "cordoned", now=now)
    alloc = Allocation.objects.create(node_id="tray-1", replica_id=uuid.uuid4(), shard_id=uuid.uuid4())
    AllocatedGPU.objects.create(allocation=alloc, node_id="tray-1", gpu_index=1)
    put(
        "tray-1",
        now=now,
        gpus=[
            {"index": 0, "util_percent": 87.0, "temp_c": 61.0, "power_w": 612.5},
            {"index": 1, "util_percent": -1, "temp_c": 40.0, "power_w": 95.0},
        ],
        ports=[
            ib_port(
                "mlx5_0",
                counters={"symbol_error": 3, "link_downed": 1, "port_xmit_data": 123456},
                tx_bps=400e9,
                rx_bps=8e9,
            )
        ],
    )
    profile = EngineProfile.objects.create(name="p", engine="vllm")
    dep = Deployment.objects.create(name="llama", served_model="llama", profile=profile, replicas=3)
    Deployment.objects.create(name="idle", served_model="idle", profile=profile, replicas=0)
    for state in (ReplicaState.READY, ReplicaState.READY, ReplicaState.PENDING):
        Replica.objects.create(deployment=dep, state=state, created_at=now, updated_at=now)
    # A deployment spanning two nodes, one replica starting with a shard on tray-1, one waiting out a backoff.
    wide = EngineProfile.objects.create(name="wide", engine="vllm", nodes=2)
    big = Deployment.objects.create(name="big", served_model="big", profile=wide, replicas=2, paused=True)
    starting = Replica.objects.create(deployment=big, state=ReplicaState.STARTING, created_at=now, updated_at=now)
    Shard.objects.create(
        replica=starting, node_id="tray-1", rank=0, http_port=8001, state="loading", created_at=now, updated_at=now
    )
    Shard.objects.create(
        replica=starting, node_id="pcie-1", rank=1, http_port=8001, state="failed", created_at=now, updated_at=now
    )
    later = now + dt.timedelta(seconds=60)
    Replica.objects.create(deployment=big, state=ReplicaState.PENDING, not_before=later, created_at=now, updated_at=now)
    LivenessClock.objects.create(id=1, last_sweep_at=now - dt.timedelta(seconds=12))
    # The worker has run the doctor (a scrape never runs its checks).
    doctor_refresh.refresh(now=now)
    return now


def test_node_metrics(client, cluster):
    m = scrape(client)
    # Only each node's current state: five one-hot rows a node were most of the body at scale.
    assert m["llmgw_node_state"] == {lbl(node="tray-1", state="ready"): 1.0, lbl(node="pcie-1", state="cordoned"): 1.0}
    ages = m["llmgw_node_heartbeat_age_seconds"]
    assert set(ages) == {lbl(node="tray-1"), lbl(node="pcie-1")}
    # Thirty seconds old when made, plus however long the scrape took.
    assert 30.0 <= ages[lbl(node="tray-1")] < 40.0
    assert m["llmgw_node_gpus"] == {lbl(node="tray-1"): 2.0, lbl(node="pcie-1"): 1.0}
    assert m["llmgw_node_gpus_nvlink_joined"] == {lbl(node="tray-1"): 1.0, lbl(node="pcie-1"): 0.0}
    assert m["llmgw_node_gpus_allocated"] == {lbl(node="tray-1"): 1.0, lbl(node="pcie-1"): 0.0}
    assert m["llmgw_imex_up"] == {lbl(node="tray-1"): 1.0}


def test_what_the_alert_rules_read(client, cluster):
    m = scrape(client)
    # Cards by class: two H100s registered on tray-1, one on pcie-1; tray-1's second one held.
    assert m["llmgw_gpus"] == {lbl(**{"class": "NVIDIA H100 80GB HBM3"}): 3.0}
    assert m["llmgw_gpus_allocated"] == {lbl(**{"class": "NVIDIA H100 80GB HBM3"}): 1.0}
    # A paused deployment has no desired count: nothing is missing from it.
    assert m["llmgw_deployment_replicas_desired"] == {lbl(deployment="llama"): 3.0, lbl(deployment="idle"): 0.0}
    assert m["llmgw_deployment_start_backoff"] == {
        lbl(deployment="big"): 1.0,
        lbl(deployment="idle"): 0.0,
        lbl(deployment="llama"): 0.0,
    }
    # The failed shard on pcie-1 no longer holds anything.
    assert m["llmgw_node_multinode_shards"] == {lbl(node="tray-1"): 1.0, lbl(node="pcie-1"): 0.0}
    assert 12.0 <= m["llmgw_liveness_sweep_age_seconds"][lbl()] < 22.0
    assert m["llmgw_liveness_mass_silence"] == {lbl(): 0.0}
    LivenessClock.objects.filter(id=1).update(disruption_since=cluster)
    assert scrape(client)["llmgw_liveness_mass_silence"] == {lbl(): 1.0}


def test_sensors_and_port_counters_are_left_to_the_agents(client, cluster):
    # The cluster's telemetry holds card sensors and port counters: none of them is served here.
    body = client.get("/metrics")
    text = b"".join(body.streaming_content).decode()
    assert "612.5" not in text and "mlx5_0" not in text
    assert not [n for n in scrape(client) if n.startswith(("llmgw_gpu_", "llmgw_ib_"))]


def test_replica_and_doctor_metrics(client, cluster):
    m = scrape(client)
    replicas = m["llmgw_replicas"]
    assert replicas[lbl(deployment="llama", state="ready")] == 2.0
    assert replicas[lbl(deployment="llama", state="pending")] == 1.0
    assert replicas[lbl(deployment="llama", state="failed")] == 0.0
    assert replicas[lbl(deployment="idle", state="ready")] == 0.0
    assert len(replicas) == 3 * len(ReplicaState.values)
    checks = m["llmgw_doctor_checks"]
    assert len(checks) == 3 * len(doctor.check_names())
    expected = {
        "nvlink_joined": "fail",
        "replicas_pending": "warn",
        "nodes_reachable": "pass",
        "imex": "pass",
        "clock_skew": "pass",
    }
    for check, result in expected.items():
        for value in ("pass", "warn", "fail"):
            assert checks[lbl(check=check, result=value)] == (1.0 if value == result else 0.0), (check, value)


def test_registering_does_not_touch_the_database(django_assert_num_queries):
    from prometheus_client import CollectorRegistry

    from inventory.metrics import LlmgwCollector

    with django_assert_num_queries(0):
        CollectorRegistry().register(LlmgwCollector())


# The scrape's queries, whatever the doctor's results (a scrape never runs its
# checks): nodes, GPUs, held GPUs, the liveness clock, deployments, replica
# counts and multi-node shards.
SCRAPE_QUERIES = 7


def build_nodes(count: int, *, now: dt.datetime) -> None:
    Node.objects.bulk_create(
        [Node(id=f"node-{i:04d}", state=NodeState.READY, last_seen=now, imex_state="UP") for i in range(count)]
    )
    GPU.objects.bulk_create(
        [GPU(node_id=f"node-{i:04d}", index=g, name="NVIDIA H100 80GB HBM3") for i in range(count) for g in range(8)]
    )
    ports = [ib_port(f"mlx5_{h}", counters={"symbol_error": 0, "link_downed": 0}) for h in range(8)]
    sensors = [{"index": g, "util_percent": 50.0, "temp_c": 50.0, "power_w": 500.0} for g in range(8)]
    at = now.timestamp()
    cache.set_many(
        {
            telemetry.key(f"node-{i:04d}"): {"at": at, "agent_at": at, "gpus": sensors, "ib_ports": ports}
            for i in range(count)
        }
    )


def test_scrape_query_count_is_constant(client, django_assert_num_queries, cluster):
    with django_assert_num_queries(SCRAPE_QUERIES):
        small = scrape(client)
    assert len(small["llmgw_node_state"]) == 2


def test_scrape_query_count_at_1000_nodes(client, django_assert_num_queries):
    now = timezone.now()
    build_nodes(1000, now=now)
    doctor_refresh.refresh(now=now)
    with django_assert_num_queries(SCRAPE_QUERIES):
        m = scrape(client)
    assert len(m["llmgw_node_state"]) == 1000
    assert m["llmgw_node_gpus"][lbl(node="node-0999")] == 8.0
    # Seven samples a node (state, heartbeat age, cards, held, joined, IMEX, multi-node shards),
    # whatever its cards and ports;
    # then the doctor's, its age, the one class's cards and held cards, and the mass-silence flag.
    # (The process's own counters, such as cache errors, depend on what this process met before.)
    ours = {name: samples for name, samples in m.items() if name not in PROCESS_COUNTERS}
    assert sum(len(samples) for samples in ours.values()) == 7 * 1000 + 3 * len(doctor.check_names()) + 1 + 3


METRIC_NAMES = {
    "llmgw_node_state",
    "llmgw_node_heartbeat_age_seconds",
    "llmgw_node_gpus",
    "llmgw_node_gpus_allocated",
    "llmgw_node_gpus_nvlink_joined",
    "llmgw_imex_up",
    "llmgw_gpus",
    "llmgw_gpus_allocated",
    "llmgw_liveness_sweep_age_seconds",
    "llmgw_liveness_mass_silence",
    "llmgw_replicas",
    "llmgw_deployment_replicas_desired",
    "llmgw_deployment_start_backoff",
    "llmgw_node_multinode_shards",
    "llmgw_doctor_checks",
    "llmgw_doctor_age_seconds",
}
# The autoscaler's families: described always, with samples only for autoscaled deployments (none here).
AUTOSCALE_FAMILIES = {
    "llmgw_autoscale_desired_replicas",
    "llmgw_autoscale_recommended_replicas",
    "llmgw_autoscale_signal",
    "llmgw_autoscale_held_requests",
    "llmgw_autoscale_steps",
}
# Counted by each web process (inventory/telemetry.py), every op present from the start.
PROCESS_COUNTERS = {"llmgw_telemetry_cache_errors_total"}


def test_collector_exports_exactly_the_documented_names(client, cluster):
    assert set(scrape(client)) == METRIC_NAMES | PROCESS_COUNTERS


def agent_metric_names() -> set[str]:
    """The families an agent serves for a node with every sensor, wear counter and port counter."""
    import llmgw_wire as wire
    from llmgw_agent.metrics import render

    hb = wire.Heartbeat(
        node_id="n",
        at=0.0,
        load=wire.Load(),
        gpus=[
            wire.GPUSensor(
                index=0, temp_c=50, power_w=300, util_percent=50, wear=wire.GPUWear(xid_errors=1, pcie_replays=2)
            )
        ],
        ib_ports=[wire.IBPort(hca="mlx5_0", port=1, counters={"port_xmit_data": 1, "symbol_error": 0})],
    )
    return {line.split()[2] for line in render(hb, now=0.0).splitlines() if line.startswith("# TYPE")}


def test_grafana_dashboard_uses_every_metric_and_no_other():
    import json
    import re
    from pathlib import Path

    from django.conf import settings

    from tests.deploy.prometheus import expanded

    dash = json.loads((Path(settings.BASE_DIR) / "deploy" / "grafana" / "llmgw.json").read_text())
    # Recording rules (deploy/prometheus/llmgw.rules.yml) stand for what they read.
    exprs = [expanded(t["expr"]) for p in dash["panels"] for t in p.get("targets", [])]
    used = {name for e in exprs for name in re.findall(r"llmgw_[a-z_]+", e)}
    # The gateway's own families are the data plane's (tests/gateway/test_dataplane_metrics.py); every
    # control-plane metric is on it; the rest are ones the agents really serve.
    used = {n for n in used if not n.startswith("llmgw_gateway_")}
    assert used & (METRIC_NAMES | PROCESS_COUNTERS) == METRIC_NAMES | PROCESS_COUNTERS
    assert used - METRIC_NAMES - PROCESS_COUNTERS == {
        "llmgw_node_gpu_utilization_ratio",
        "llmgw_node_gpu_temperature_celsius",
        "llmgw_node_gpu_power_watts",
        "llmgw_node_gpu_xid_errors_total",
        "llmgw_node_gpu_pcie_replays_total",
        "llmgw_node_ib_port_data_bytes_total",
        "llmgw_node_ib_port_errors_total",
    }
    assert used - METRIC_NAMES - PROCESS_COUNTERS <= agent_metric_names()
    assert dash["uid"] == "llmgw"


# --- the direct writer, the collector, the doctor's reuse ----------------------


def test_render_writes_what_generate_latest_writes(cluster):
    from prometheus_client import CollectorRegistry, generate_latest

    from inventory.metrics import Family, collect_families, render

    families = collect_families()
    odd = Family("llmgw_odd", "counter", 'a "help"\\ with\na newline', ("zeta", "alpha"))
    odd.rows += [(('q"uote', "back\\slash"), 1.5e10), (("new\nline", ""), float("inf")), (("a", "b"), 0.1)]
    families.append(odd)

    class Fixed:
        def collect(self):
            return [f.metric() for f in families]

    registry = CollectorRegistry()
    registry.register(Fixed())
    assert render(families).encode() == generate_latest(registry)


def test_collector_yields_the_same_families(cluster):
    from prometheus_client import CollectorRegistry

    from inventory.metrics import LlmgwCollector

    registry = CollectorRegistry()
    registry.register(LlmgwCollector())
    names = {m.name for m in registry.collect()}
    assert names == {n.removesuffix("_total") for n in METRIC_NAMES} | AUTOSCALE_FAMILIES
    assert registry.get_sample_value("llmgw_node_gpus_allocated", {"node": "tray-1"}) == 1.0


def test_a_scrape_within_the_window_reuses_the_doctor(client, cluster, django_assert_num_queries, settings):
    from inventory.nodes import change_state

    settings.LLMGW_DOCTOR_CACHE = 15.0
    first = scrape(client)
    assert first["llmgw_doctor_checks"][lbl(check="nodes_reachable", result="pass")] == 1.0
    change_state("tray-1", "unreachable", now=cluster)
    # Nodes, GPUs, held GPUs, the liveness clock, deployments, replica counts and multi-node
    # shards: the doctor's own reads are skipped.
    with django_assert_num_queries(7):
        second = scrape(client)
    assert second["llmgw_doctor_checks"] == first["llmgw_doctor_checks"]
    assert second["llmgw_node_state"][lbl(node="tray-1", state="unreachable")] == 1.0
    assert lbl(node="tray-1", state="ready") not in second["llmgw_node_state"]
    doctor.forget_cached()
    # Past the window: the last results at once (their age says so), and the worker refreshes them.
    third = scrape(client)
    assert third["llmgw_doctor_checks"] == first["llmgw_doctor_checks"]
    doctor_refresh.refresh_doctor()
    fourth = scrape(client)
    assert fourth["llmgw_doctor_checks"][lbl(check="nodes_reachable", result="warn")] == 1.0


def test_the_api_says_when_its_checks_ran_and_runs_them_fresh_on_demand(client, viewer, cluster):
    from inventory.nodes import change_state

    client.force_login(viewer)
    first = client.get("/api/v1/doctor").json()
    change_state("tray-1", "unreachable", now=cluster)
    again = client.get("/api/v1/doctor").json()
    assert again == first
    fresh = client.get("/api/v1/doctor?fresh=1").json()
    assert fresh["at"] > first["at"]
    reachable = next(c for c in fresh["checks"] if c["name"] == "nodes_reachable")
    assert (reachable["result"], reachable["nodes"]) == ("warn", ["tray-1"])
    assert client.get("/api/v1/doctor").json() == fresh


# --- who may scrape; streamed, compressed ----------------------------------------


@pytest.fixture
def closed(settings):
    settings.LLMGW_METRICS_TOKEN = ""
    settings.LLMGW_METRICS_ALLOW = []
    return settings


def test_metrics_are_refused_to_anyone_by_default(client, closed, viewer_without_node_view):
    for c_user in (None, viewer_without_node_view):
        if c_user:
            client.force_login(c_user)
        resp = client.get("/metrics")
        assert resp.status_code == 401
        assert resp["WWW-Authenticate"] == 'Bearer realm="llmgw-metrics"'
        assert b"llmgw_" not in resp.content


def test_metrics_with_the_bearer_token(client, closed):
    closed.LLMGW_METRICS_TOKEN = "scrape-secret"
    assert client.get("/metrics", HTTP_AUTHORIZATION="Bearer wrong").status_code == 401
    assert client.get("/metrics", HTTP_AUTHORIZATION="Basic scrape-secret").status_code == 401
    assert client.get("/metrics", HTTP_AUTHORIZATION="Bearer scrape-secret").status_code == 200


def test_metrics_from_an_allowed_network_only(client, closed):
    closed.LLMGW_METRICS_ALLOW = [ipaddress.ip_network("10.1.0.0/16")]
    assert client.get("/metrics", REMOTE_ADDR="10.2.0.5").status_code == 401
    assert client.get("/metrics", REMOTE_ADDR="10.1.7.9").status_code == 200


def test_metrics_for_a_signed_in_viewer(client, closed, viewer):
    client.force_login(viewer)
    assert client.get("/metrics").status_code == 200


@pytest.fixture
def viewer_without_node_view(django_user_model):
    return django_user_model.objects.create_user("nobody", password="x")


def test_the_scrape_is_streamed_and_gzipped_when_asked(client, cluster):
    import gzip

    plain = client.get("/metrics")
    assert plain.streaming
    assert "Content-Encoding" not in plain
    text = b"".join(plain.streaming_content)
    zipped = client.get("/metrics", headers={"accept-encoding": "gzip, deflate"})
    assert zipped["Content-Encoding"] == "gzip"
    assert "Accept-Encoding" in zipped["Vary"]
    body = gzip.decompress(b"".join(zipped.streaming_content))

    # The same text apart from django-prometheus' own request counters, which the first scrape moved.
    def ours(raw: bytes) -> list[bytes]:
        # The ages (heartbeats, the doctor's results, the sweep) move between two scrapes; the rest of llmgw's stays.
        return [
            line
            for line in raw.splitlines()
            if line.startswith(b"llmgw_")
            and not any(age in line for age in (b"heartbeat_age", b"doctor_age", b"sweep_age"))
        ]

    assert ours(body) == ours(text)
    assert len(ours(body)) > 10
    assert b'llmgw_node_state{node="tray-1",state="ready"} 1.0' in body
