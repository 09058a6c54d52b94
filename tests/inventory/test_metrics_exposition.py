"""/metrics' text byte for byte: llmgw's families plain and gzipped, and as prometheus_client writes them."""

from __future__ import annotations

import datetime as dt
import gzip
import math
import uuid

import pytest
from django.utils import timezone
from prometheus_client import CollectorRegistry, generate_latest

from inventory import doctor_refresh
from inventory.metrics import Family, LlmgwCollector, render
from inventory.models import GPU, AllocatedGPU, Allocation, Node, NodeState

pytestmark = [
    pytest.mark.django_db,
    # The odd node's name is in its cache keys, which Redis takes and only memcached would refuse.
    pytest.mark.filterwarnings("ignore::django.core.cache.backends.base.CacheKeyWarning"),
]

NOW = dt.datetime(2026, 11, 30, 12, 0, 0, tzinfo=dt.UTC)
# A name with every character the text format escapes in a label value.
ODD = 'o"dd\\node\nx'
JOINED = {
    "fabric_state": "Completed",
    "fabric_status": "Success",
    "cluster_uuid": "c1a5e7e2-7c9b-4d1a-9f1e-2b3c4d5e6f70",
}


@pytest.fixture
def frozen(monkeypatch) -> dt.datetime:
    """Every reader of the clock at NOW, so two scrapes write the same ages."""
    monkeypatch.setattr(timezone, "now", lambda: NOW)
    return NOW


@pytest.fixture
def odd_cluster(frozen):
    Node.objects.create(id=ODD, state=NodeState.READY, last_seen=NOW - dt.timedelta(seconds=30.25), imex_state="UP")
    # A heartbeat stamped ahead of this clock (another process's) is written as age 0, never negative.
    Node.objects.create(
        id="tray-1", state=NodeState.CORDONED, last_seen=NOW + dt.timedelta(seconds=2), imex_state="DOWN"
    )
    Node.objects.create(id="silent", state=NodeState.READY)
    GPU.objects.create(node_id=ODD, index=0, name="NVIDIA GB200", **JOINED)
    GPU.objects.create(node_id=ODD, index=1, name="NVIDIA GB200", **{**JOINED, "fabric_state": "In Progress"})
    GPU.objects.create(node_id="tray-1", index=0, name="NVIDIA H100 80GB HBM3")
    alloc = Allocation.objects.create(node_id=ODD, replica_id=uuid.uuid4(), shard_id=uuid.uuid4())
    AllocatedGPU.objects.create(allocation=alloc, node_id=ODD, gpu_index=1)
    return NOW


E = 'o\\"dd\\\\node\\nx'  # ODD as the text format writes it
NODE_FAMILIES = f"""\
# HELP llmgw_node_state 1 for the node's current state (other states are not written).
# TYPE llmgw_node_state gauge
llmgw_node_state{{node="{E}",state="ready"}} 1.0
llmgw_node_state{{node="silent",state="ready"}} 1.0
llmgw_node_state{{node="tray-1",state="cordoned"}} 1.0
# HELP llmgw_node_heartbeat_age_seconds Seconds since the node's last heartbeat.
# TYPE llmgw_node_heartbeat_age_seconds gauge
llmgw_node_heartbeat_age_seconds{{node="{E}"}} 30.25
llmgw_node_heartbeat_age_seconds{{node="tray-1"}} 0.0
# HELP llmgw_node_gpus Cards the node registered.
# TYPE llmgw_node_gpus gauge
llmgw_node_gpus{{node="{E}"}} 2.0
llmgw_node_gpus{{node="silent"}} 0.0
llmgw_node_gpus{{node="tray-1"}} 1.0
# HELP llmgw_node_gpus_allocated Cards a shard holds.
# TYPE llmgw_node_gpus_allocated gauge
llmgw_node_gpus_allocated{{node="{E}"}} 1.0
llmgw_node_gpus_allocated{{node="silent"}} 0.0
llmgw_node_gpus_allocated{{node="tray-1"}} 0.0
# HELP llmgw_node_gpus_nvlink_joined Cards joined to a multi-node NVLink fabric.
# TYPE llmgw_node_gpus_nvlink_joined gauge
llmgw_node_gpus_nvlink_joined{{node="{E}"}} 1.0
llmgw_node_gpus_nvlink_joined{{node="silent"}} 0.0
llmgw_node_gpus_nvlink_joined{{node="tray-1"}} 0.0
# HELP llmgw_imex_up 1 when nvidia-imex is up (nodes that report IMEX only).
# TYPE llmgw_imex_up gauge
llmgw_imex_up{{node="{E}"}} 1.0
llmgw_imex_up{{node="tray-1"}} 0.0
# HELP llmgw_gpus Cards registered, by class (the card's model).
# TYPE llmgw_gpus gauge
llmgw_gpus{{class="NVIDIA GB200"}} 2.0
llmgw_gpus{{class="NVIDIA H100 80GB HBM3"}} 1.0
# HELP llmgw_gpus_allocated Cards a shard holds, by class (the card's model).
# TYPE llmgw_gpus_allocated gauge
llmgw_gpus_allocated{{class="NVIDIA GB200"}} 1.0
llmgw_gpus_allocated{{class="NVIDIA H100 80GB HBM3"}} 0.0
# HELP llmgw_liveness_sweep_age_seconds Seconds since the last liveness sweep (not written before the first).
# TYPE llmgw_liveness_sweep_age_seconds gauge
# HELP llmgw_liveness_mass_silence 1 while most of the fleet is silent at once: no node is judged meanwhile.
# TYPE llmgw_liveness_mass_silence gauge
llmgw_liveness_mass_silence 0.0
# HELP llmgw_replicas Replicas of each deployment by state.
# TYPE llmgw_replicas gauge
# HELP llmgw_deployment_replicas_desired Replicas the reconciler keeps (paused deployments are not written).
# TYPE llmgw_deployment_replicas_desired gauge
# HELP llmgw_deployment_start_backoff Pending replicas waiting out a backoff after failed starts or placements.
# TYPE llmgw_deployment_start_backoff gauge
# HELP llmgw_node_multinode_shards Live shards on the node of replicas that span several nodes \
(0 for every other node).
# TYPE llmgw_node_multinode_shards gauge
llmgw_node_multinode_shards{{node="{E}"}} 0.0
llmgw_node_multinode_shards{{node="silent"}} 0.0
llmgw_node_multinode_shards{{node="tray-1"}} 0.0
# HELP llmgw_autoscale_desired_replicas Replicas the autoscaler set for each autoscaled deployment.
# TYPE llmgw_autoscale_desired_replicas gauge
# HELP llmgw_autoscale_recommended_replicas Replicas the load alone asked for at the last pass, before the windows.
# TYPE llmgw_autoscale_recommended_replicas gauge
# HELP llmgw_autoscale_signal The autoscaling metric at the last pass (per replica; seconds for TTFT).
# TYPE llmgw_autoscale_signal gauge
# HELP llmgw_autoscale_held_requests Requests held by the gateways at the last pass (no replica ready).
# TYPE llmgw_autoscale_held_requests gauge
# HELP llmgw_autoscale_steps_total Changes of the replica count the autoscaler made (its events, as kept).
# TYPE llmgw_autoscale_steps_total counter
# HELP llmgw_doctor_checks 1 for each doctor check's current result, 0 for the others.
# TYPE llmgw_doctor_checks gauge
"""


def ours(body: bytes) -> str:
    """llmgw's families: everything from the first of them on (before it, django-prometheus' and the process's)."""
    text = body.decode()
    start = text.index("# HELP llmgw_node_state ")
    return text[start:]


def test_the_scrape_writes_exactly_these_lines_plain_and_gzipped(client, odd_cluster):
    # The worker's refresh, at this same clock (a scrape never runs the checks).
    doctor_refresh.refresh()
    plain = b"".join(client.get("/metrics").streaming_content)
    zipped = client.get("/metrics", headers={"accept-encoding": "gzip"})
    assert zipped["Content-Encoding"] == "gzip"
    assert "Accept-Encoding" in zipped["Vary"]
    unzipped = gzip.decompress(b"".join(zipped.streaming_content))

    text = ours(plain)
    assert text == ours(unzipped)
    assert text.startswith(NODE_FAMILIES)
    assert text.endswith(
        "# HELP llmgw_doctor_age_seconds Age of the doctor's results above (refreshed out of band); -1 while none "
        "were ever kept.\n"
        "# TYPE llmgw_doctor_age_seconds gauge\n"
        "llmgw_doctor_age_seconds 0.0\n"
    )
    # And all of it as prometheus_client itself writes the same families.
    registry = CollectorRegistry()
    registry.register(LlmgwCollector())
    assert text == generate_latest(registry).decode()


def test_the_scrape_is_not_gzipped_unless_asked(client, odd_cluster):
    resp = client.get("/metrics", headers={"accept-encoding": "identity"})
    assert "Content-Encoding" not in resp
    assert "Accept-Encoding" in resp["Vary"]
    assert ours(b"".join(resp.streaming_content)).startswith(NODE_FAMILIES)


def test_values_and_labels_written_once_a_scrape_stay_exact():
    # One escaped label tuple and one formatted value serve later rows: a
    # negative zero, a NaN or a large count must not take another's text.
    a = Family("llmgw_a", "gauge", "a", ("node",))
    b = Family("llmgw_b", "counter", "b", ("host",))
    values = [0.0, -0.0, 0.0, -0.0, 1, 1.0, float("nan"), math.inf, -math.inf, 1.5e10, 123456789.0, 2.5]
    for i, v in enumerate(values):
        a.rows.append(((ODD if i % 2 else f"n{i}",), v))
        b.rows.append(((ODD,), v))
    c = Family("llmgw_c", "gauge", "c", ("zeta", "alpha"))
    c.rows += [((ODD, ODD), -0.0), (("", ODD), 0.0)]

    class Fixed:
        def collect(self):
            return [f.metric() for f in (a, b, c)]

    registry = CollectorRegistry()
    registry.register(Fixed())
    text = render([a, b, c])
    assert text.encode() == generate_latest(registry)
    assert f'llmgw_a{{node="{E}"}} -0.0\n' in text
    assert 'llmgw_a{node="n2"} 0.0\n' in text
