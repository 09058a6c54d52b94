"""Prometheus HTTP service discovery: every agent's and every ready engine's metrics endpoint.

Prometheus scales by scraping each machine for what it measures; what it
needs from the control plane is the list of machines and the labels that say
where each one sits (node, fabrics, NVLink domain, deployment). The list is
the `http_sd_config` format: a JSON array of {"targets": [...], "labels": {...}}.

Agents and engines answer with different credentials (the agent's
metrics_token; engines none), so Prometheus scrapes them as two jobs:
`?kind=agent` and `?kind=engine` give each job its own list.

Built in a fixed number of queries, whatever the number of nodes and
replicas: nodes, their fabric attachments, ready replicas with their leader
shard and the shard's node.

It lives in placement because it lists replicas; nodes are read from inventory.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any
from urllib.parse import urlsplit

from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.http import require_GET

from inventory.metrics import refuse_scrape
from inventory.models import FabricAttachment, Node
from placement.models import ReplicaState, Shard

KINDS = ("agent", "engine")


def agent_targets() -> list[dict[str, Any]]:
    """One target group per node whose agent serves metrics, labelled with where the node sits."""
    fabrics: dict[str, list[str]] = defaultdict(list)
    for node_id, name in FabricAttachment.objects.order_by("node_id", "name").values_list("node_id", "name"):
        fabrics[node_id].append(name)
    groups = []
    rows = (
        Node.objects.exclude(metrics_addr="").order_by("id").values_list("id", "metrics_addr", "nvlink_domain", "state")
    )
    for node_id, addr, domain, state in rows:
        groups.append(
            {
                "targets": [addr],
                "labels": {
                    "job_kind": "agent",
                    "node": node_id,
                    # Comma-joined, so a relabel or a query matches one with a regex (".*ib-a.*").
                    "fabrics": ",".join(fabrics.get(node_id, [])),
                    "nvlink_domain": domain,
                    "state": state,
                },
            }
        )
    return groups


def engine_targets() -> list[dict[str, Any]]:
    """One target group per ready replica: its leader's engine endpoint, labelled with the deployment."""
    leaders = (
        Shard.objects.filter(replica__state=ReplicaState.READY, rank=0)
        .order_by("replica__deployment__name", "replica_id")
        .values_list(
            "replica_id",
            "replica__endpoint",
            "replica__deployment__name",
            "replica__deployment__profile__engine",
            "node_id",
            "node__mgmt_addr",
            "http_port",
        )
    )
    groups = []
    for replica_id, endpoint, deployment, engine, node_id, mgmt_addr, port in leaders:
        # The endpoint the gateway routes to is where the engine's own /metrics is served.
        target = urlsplit(endpoint).netloc if endpoint else f"{mgmt_addr}:{port}"
        groups.append(
            {
                "targets": [target],
                "labels": {
                    "job_kind": "engine",
                    "deployment": deployment,
                    "replica": str(replica_id),
                    "engine": engine,
                    "node": node_id,
                },
            }
        )
    return groups


def targets(kinds: tuple[str, ...] = KINDS) -> list[dict[str, Any]]:
    """The discovery document for the given kinds of target."""
    out: list[dict[str, Any]] = []
    if "agent" in kinds:
        out += agent_targets()
    if "engine" in kinds:
        out += engine_targets()
    return out


@require_GET
def targets_view(request: HttpRequest) -> HttpResponse:
    """/api/v1/prometheus/targets[?kind=agent|engine]: the http_sd_config document; 400 naming `kind` if unknown.

    Guarded as /metrics is (a bearer token, an allowed address, or a viewer of nodes): it lists every node.
    """
    if (refused := refuse_scrape(request)) is not None:
        return refused
    kind = request.GET.get("kind", "")
    if kind and kind not in KINDS:
        return JsonResponse({"kind": [f"must be one of {', '.join(KINDS)}, not {kind!r}"]}, status=400)
    return JsonResponse(targets((kind,) if kind else KINDS), safe=False)
