"""llmgw's own Prometheus metrics, computed when /metrics is scraped.

A custom collector rather than gauges updated as things happen: the truth is
in the database and the telemetry cache, shared by many web processes, so
each scrape reads it whole, in a constant number of queries (one snapshot
for the doctor, plus allocations and replica counts), whatever the number of
nodes. django-prometheus serves it beside its own metrics.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from django.db.models import Count
from django.utils import timezone
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import REGISTRY, Collector

from inventory import doctor
from inventory import gpus as gpu_rules
from inventory.models import AllocatedGPU, NodeState

# Telemetry rates (tx_bps, rx_bps) are bits per second, like every link rate
# in the agent's reports; the metric is in bytes per second.
BITS_PER_BYTE = 8


def _families() -> dict[str, Metric]:
    return {
        "node_state": GaugeMetricFamily(
            "llmgw_node_state", "1 for the node's current state, 0 for the others.", labels=["node", "state"]
        ),
        "heartbeat_age": GaugeMetricFamily(
            "llmgw_node_heartbeat_age_seconds", "Seconds since the node's last heartbeat.", labels=["node"]
        ),
        "nvlink_joined": GaugeMetricFamily(
            "llmgw_gpu_nvlink_joined",
            "1 when the card is joined to a multi-node NVLink fabric.",
            labels=["node", "gpu"],
        ),
        "imex_up": GaugeMetricFamily(
            "llmgw_imex_up", "1 when nvidia-imex is up (nodes that report IMEX only).", labels=["node"]
        ),
        "utilization": GaugeMetricFamily(
            "llmgw_gpu_utilization_ratio", "GPU busy fraction, 0 to 1.", labels=["node", "gpu"]
        ),
        "temperature": GaugeMetricFamily(
            "llmgw_gpu_temperature_celsius", "GPU core temperature.", labels=["node", "gpu"]
        ),
        "power": GaugeMetricFamily("llmgw_gpu_power_watts", "GPU power draw.", labels=["node", "gpu"]),
        "allocated": GaugeMetricFamily("llmgw_gpu_allocated", "1 when a shard holds the card.", labels=["node", "gpu"]),
        "ib_rate": GaugeMetricFamily(
            "llmgw_ib_port_rate_bytes",
            "InfiniBand/RoCE port traffic in bytes per second.",
            labels=["node", "hca", "port", "direction"],
        ),
        "ib_errors": CounterMetricFamily(
            "llmgw_ib_port_errors",
            "InfiniBand port error counters as the port reports them.",
            labels=["node", "hca", "port", "counter"],
        ),
        "replicas": GaugeMetricFamily(
            "llmgw_replicas", "Replicas of each deployment by state.", labels=["deployment", "state"]
        ),
        "doctor": GaugeMetricFamily(
            "llmgw_doctor_checks",
            "1 for each doctor check's current result, 0 for the others.",
            labels=["check", "result"],
        ),
    }


def _num(value: Any) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


class LlmgwCollector(Collector):
    """Collects llmgw's metrics from the database and the telemetry cache at scrape time."""

    def describe(self) -> Iterator[Metric]:
        """The families, without samples: registering must not touch the database."""
        return iter(_families().values())

    def collect(self) -> Iterator[Metric]:
        """Read the snapshot and yield every family."""
        from placement.models import Deployment, Replica, ReplicaState

        now = timezone.now()
        inv = doctor.load_inventory(now=now)
        results = doctor.run_checks(inv)
        held = set(AllocatedGPU.objects.values_list("node_id", "gpu_index"))
        deployments = list(Deployment.objects.values_list("id", "name"))
        counts = {
            (d, s): c
            for d, s, c in Replica.objects.values_list("deployment_id", "state").annotate(n=Count("id")).order_by()
        }
        f = _families()
        for n in inv.nodes:
            for s in NodeState.values:
                f["node_state"].add_metric([n.id, s], 1.0 if n.state == s else 0.0)
            if n.last_seen is not None:
                f["heartbeat_age"].add_metric([n.id], max((now - n.last_seen).total_seconds(), 0.0))
            if n.imex_state:
                f["imex_up"].add_metric([n.id], 1.0 if n.imex_up() else 0.0)
            for g in n.gpus.all():
                gpu = str(g.index)
                joined = gpu_rules.fabric_joined(g.fabric_state, g.fabric_status, g.cluster_uuid)
                f["nvlink_joined"].add_metric([n.id, gpu], 1.0 if joined else 0.0)
                f["allocated"].add_metric([n.id, gpu], 1.0 if (n.id, g.index) in held else 0.0)
            data = inv.telemetry.get(n.id) or {}
            self._sensors(f, n.id, data)
            self._ports(f, n.id, data)
        for dep_id, name in deployments:
            for s in ReplicaState.values:
                f["replicas"].add_metric([name, s], float(counts.get((dep_id, s), 0)))
        for r in results:
            for value in doctor.Result:
                f["doctor"].add_metric([r.name, str(value)], 1.0 if r.result == value else 0.0)
        yield from f.values()

    @staticmethod
    def _sensors(f: dict[str, Metric], node_id: str, data: dict[str, Any]) -> None:
        for s in data.get("gpus") or []:
            gpu = str(s.get("index"))
            util = _num(s.get("util_percent"))
            if util is not None and util >= 0:
                f["utilization"].add_metric([node_id, gpu], util / 100.0)
            temp = _num(s.get("temp_c"))
            if temp:
                f["temperature"].add_metric([node_id, gpu], temp)
            power = _num(s.get("power_w"))
            if power:
                f["power"].add_metric([node_id, gpu], power)

    @staticmethod
    def _ports(f: dict[str, Metric], node_id: str, data: dict[str, Any]) -> None:
        for p in data.get("ib_ports") or []:
            hca, port = str(p.get("hca", "")), str(p.get("port", ""))
            for direction, k in (("tx", "tx_bps"), ("rx", "rx_bps")):
                rate = _num(p.get(k))
                if rate is not None:
                    f["ib_rate"].add_metric([node_id, hca, port, direction], rate / BITS_PER_BYTE)
            counters = p.get("counters") or {}
            for name in doctor.ERROR_COUNTERS:
                value = _num(counters.get(name))
                if value is not None:
                    f["ib_errors"].add_metric([node_id, hca, port, name], value)


_registered: LlmgwCollector | None = None


def register() -> LlmgwCollector:
    """Register the collector with prometheus_client's default registry, once per process."""
    global _registered
    if _registered is None:
        _registered = LlmgwCollector()
        REGISTRY.register(_registered)
    return _registered
