"""llmgw's own Prometheus metrics, computed when /metrics is scraped.

Computed at scrape time rather than kept in gauges updated as things happen:
the truth is in the database and the telemetry cache, shared by many web
processes, so each scrape reads it whole, in a constant number of queries
(one snapshot for the doctor, plus allocations and replica counts), whatever
the number of nodes.

At 5,000 nodes a scrape has over half a million samples. prometheus_client
builds an object per sample and checks every label name of every sample as it
writes the text, which alone took seconds; so /metrics (`export`) writes
django-prometheus' metrics with prometheus_client and llmgw's families with
`render`, which writes the same text (a test compares the two byte for byte).
`LlmgwCollector` yields the same families for any other registry.

The doctor's results come from `doctor.latest`: a scrape within
settings.LLMGW_DOCTOR_CACHE seconds of another reuses its checks.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from django.conf import settings
from django.db.models import Count
from django.http import HttpRequest, HttpResponse
from django.utils import timezone
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest, multiprocess
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import REGISTRY, Collector
from prometheus_client.utils import floatToGoString

from inventory import doctor
from inventory import gpus as gpu_rules
from inventory.models import AllocatedGPU, NodeState


@dataclass(slots=True)
class Family:
    """One metric family: its name, type, help and label names, and its samples as (label values, value)."""

    name: str
    kind: str
    help: str
    labels: tuple[str, ...]
    rows: list[tuple[tuple[str, ...], float]] = field(default_factory=list)

    def metric(self) -> Metric:
        """The family as prometheus_client's object (for a registry)."""
        cls = CounterMetricFamily if self.kind == "counter" else GaugeMetricFamily
        m = cls(self.name, self.help, labels=list(self.labels))
        for values, value in self.rows:
            m.add_metric(list(values), value)
        return m

    def render(self, out: list[str]) -> None:
        """Append the family in the text format, as prometheus_client.generate_latest writes it."""
        name = f"{self.name}_total" if self.kind == "counter" else self.name
        doc = self.help.replace("\\", r"\\").replace("\n", r"\n")
        out.append(f"# HELP {name} {doc}\n# TYPE {name} {self.kind}\n")
        # Labels sorted by name, as generate_latest does; one template per family.
        order = sorted(range(len(self.labels)), key=self.labels.__getitem__)
        pairs = ",".join(f'{self.labels[i]}="{{{i}}}"' for i in order)
        template = f"{name}{{{{{pairs}}}}} {{{len(self.labels)}}}\n"
        fmt = template.format
        go = floatToGoString
        for values, value in self.rows:
            out.append(fmt(*map(_escape, values), go(value)))


def _escape(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _families() -> dict[str, Family]:
    return {
        "node_state": Family(
            "llmgw_node_state", "gauge", "1 for the node's current state, 0 for the others.", ("node", "state")
        ),
        "heartbeat_age": Family(
            "llmgw_node_heartbeat_age_seconds", "gauge", "Seconds since the node's last heartbeat.", ("node",)
        ),
        "nvlink_joined": Family(
            "llmgw_gpu_nvlink_joined",
            "gauge",
            "1 when the card is joined to a multi-node NVLink fabric.",
            ("node", "gpu"),
        ),
        "imex_up": Family(
            "llmgw_imex_up", "gauge", "1 when nvidia-imex is up (nodes that report IMEX only).", ("node",)
        ),
        "utilization": Family("llmgw_gpu_utilization_ratio", "gauge", "GPU busy fraction, 0 to 1.", ("node", "gpu")),
        "temperature": Family("llmgw_gpu_temperature_celsius", "gauge", "GPU core temperature.", ("node", "gpu")),
        "power": Family("llmgw_gpu_power_watts", "gauge", "GPU power draw.", ("node", "gpu")),
        "allocated": Family("llmgw_gpu_allocated", "gauge", "1 when a shard holds the card.", ("node", "gpu")),
        "ib_rate": Family(
            "llmgw_ib_port_rate_bytes_per_second",
            "gauge",
            "InfiniBand/RoCE port traffic in bytes per second.",
            ("node", "hca", "port", "direction"),
        ),
        "ib_errors": Family(
            "llmgw_ib_port_errors",
            "counter",
            "InfiniBand port error counters as the port reports them.",
            ("node", "hca", "port", "counter"),
        ),
        "replicas": Family("llmgw_replicas", "gauge", "Replicas of each deployment by state.", ("deployment", "state")),
        "doctor": Family(
            "llmgw_doctor_checks",
            "gauge",
            "1 for each doctor check's current result, 0 for the others.",
            ("check", "result"),
        ),
    }


def _num(value: Any) -> float | None:
    if type(value) is float:
        return value
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def collect_families() -> list[Family]:
    """Read the snapshot (and the doctor's latest results) and fill every family."""
    from placement.models import Deployment, Replica, ReplicaState

    now = timezone.now()
    # The doctor's results, when recent, need only the metrics' own part of the snapshot.
    hit = doctor.cached(now=now)
    inv = doctor.load_inventory(now=now, checks=hit is None)
    results = hit[1] if hit is not None else doctor.latest(now=now, fresh=True, inv=inv)[1]
    held = set(AllocatedGPU.objects.values_list("node_id", "gpu_index"))
    deployments = list(Deployment.objects.values_list("id", "name"))
    counts = {
        (d, s): c
        for d, s, c in Replica.objects.values_list("deployment_id", "state").annotate(n=Count("id")).order_by()
    }
    f = _families()
    node_state, heartbeat_age, imex_up = f["node_state"].rows, f["heartbeat_age"].rows, f["imex_up"].rows
    nvlink_joined, allocated = f["nvlink_joined"].rows, f["allocated"].rows
    states = NodeState.values
    joined_rule = gpu_rules.fabric_joined
    for n in inv.nodes:
        nid = n.id
        node_state.extend(((nid, s), 1.0 if n.state == s else 0.0) for s in states)
        if n.last_seen is not None:
            heartbeat_age.append(((nid,), max((now - n.last_seen).total_seconds(), 0.0)))
        if n.imex_state:
            imex_up.append(((nid,), 1.0 if n.imex_up() else 0.0))
        for g in inv.gpus(nid):
            gpu = str(g.index)
            joined = joined_rule(g.fabric_state, g.fabric_status, g.cluster_uuid)
            nvlink_joined.append(((nid, gpu), 1.0 if joined else 0.0))
            allocated.append(((nid, gpu), 1.0 if (nid, g.index) in held else 0.0))
        data = inv.telemetry.get(nid) or {}
        _sensors(f, nid, data)
        _ports(f, nid, data)
    for dep_id, name in deployments:
        for s in ReplicaState.values:
            f["replicas"].rows.append(((name, s), float(counts.get((dep_id, s), 0))))
    for r in results:
        for value in doctor.Result:
            f["doctor"].rows.append(((r.name, str(value)), 1.0 if r.result == value else 0.0))
    return list(f.values())


def _sensors(f: dict[str, Family], node_id: str, data: dict[str, Any]) -> None:
    utilization, temperature, power = f["utilization"].rows, f["temperature"].rows, f["power"].rows
    for s in data.get("gpus") or []:
        labels = (node_id, str(s.get("index")))
        util = _num(s.get("util_percent"))
        if util is not None and util >= 0:
            utilization.append((labels, util / 100.0))
        temp = _num(s.get("temp_c"))
        if temp:
            temperature.append((labels, temp))
        power_w = _num(s.get("power_w"))
        if power_w:
            power.append((labels, power_w))


# The telemetry's port rates are bits a second, as link rates are quoted; the
# metric is bytes a second, as Prometheus' base units ask.
BITS_PER_BYTE = 8


def _ports(f: dict[str, Family], node_id: str, data: dict[str, Any]) -> None:
    rates, errors = f["ib_rate"].rows, f["ib_errors"].rows
    for p in data.get("ib_ports") or []:
        hca, port = str(p.get("hca", "")), str(p.get("port", ""))
        for direction, k in (("tx", "tx_bps"), ("rx", "rx_bps")):
            rate = _num(p.get(k))
            if rate is not None:
                rates.append(((node_id, hca, port, direction), rate / BITS_PER_BYTE))
        counters = p.get("counters") or {}
        for name in doctor.ERROR_COUNTERS:
            value = _num(counters.get(name))
            if value is not None:
                errors.append(((node_id, hca, port, name), value))


def render(families: list[Family]) -> str:
    """The families in Prometheus' text format."""
    out: list[str] = []
    for family in families:
        family.render(out)
    return "".join(out)


class LlmgwCollector(Collector):
    """llmgw's metrics as a prometheus_client collector, for a registry of one's own.

    /metrics does not go through it (see the module docstring); it yields the
    same families.
    """

    def describe(self) -> Iterator[Metric]:
        """The families, without samples: registering must not touch the database."""
        return iter([f.metric() for f in _families().values()])

    def collect(self) -> Iterator[Metric]:
        """Read the snapshot and yield every family."""
        for family in collect_families():
            yield family.metric()


def may_scrape(*, authorization: str | None, remote_addr: str | None, user: Any = None) -> bool:
    """Whether a /metrics request may read the metrics (settings.LLMGW_METRICS_TOKEN, LLMGW_METRICS_ALLOW).

    The way Prometheus is usually given access: its bearer token (compared in
    constant time), or its address in an allowlist; an operator signed in
    with the view permission on nodes sees what the node API shows them anyway.
    """
    token = settings.LLMGW_METRICS_TOKEN
    if token and authorization:
        scheme, _, given = authorization.partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token.encode()):
            return True
    if settings.LLMGW_METRICS_ALLOW and remote_addr:
        try:
            addr = ipaddress.ip_address(remote_addr)
        except ValueError:
            addr = None
        if addr is not None and any(addr in net for net in settings.LLMGW_METRICS_ALLOW):
            return True
    return bool(user is not None and user.is_authenticated and user.has_perm("inventory.view_node"))


def export(request: HttpRequest) -> HttpResponse:
    """/metrics: django-prometheus' metrics, as its own view serves them, then llmgw's; 401 to whoever may not."""
    if not may_scrape(
        authorization=request.META.get("HTTP_AUTHORIZATION"),
        remote_addr=request.META.get("REMOTE_ADDR"),
        user=getattr(request, "user", None),
    ):
        resp = HttpResponse(
            "metrics need a bearer token or an allowed address\n", status=401, content_type="text/plain"
        )
        resp["WWW-Authenticate"] = 'Bearer realm="llmgw-metrics"'
        return resp
    if "PROMETHEUS_MULTIPROC_DIR" in os.environ or "prometheus_multiproc_dir" in os.environ:
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
    else:
        registry = REGISTRY
    body = generate_latest(registry) + render(collect_families()).encode()
    return HttpResponse(body, content_type=CONTENT_TYPE_LATEST)
