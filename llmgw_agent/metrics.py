"""The agent's own Prometheus endpoint: this node's sensors, wear, ports and shards.

At ten thousand nodes the control plane cannot be the one exporter of every
card's temperature and every port's error counters: one scrape of it was
117 MB and 10 s. Prometheus is meant to scrape each node for what the node
measures, so each agent serves its own last sample here, a few hundred
samples, and the control plane lists the agents for Prometheus (HTTP service
discovery) and keeps only what it alone knows.

The text is written by hand (the exposition format is a few lines) so the
agent needs no Prometheus library. Samples carry no node label: the service
discovery's target labels (node, fabrics, NVLink domain) are attached by
Prometheus to every sample of the target.

Counters are exported as the hardware reports them (IB data counters in
bytes, errors as counts): rates are Prometheus' job (`rate()`), so a missed
scrape loses nothing.

Protected like the control plane's /metrics: a bearer token, or open only
when agent.yaml says `metrics_open: true`.
"""

from __future__ import annotations

import hmac
import logging
import threading
import time
from collections.abc import Callable, Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import llmgw_wire as wire
from llmgw_agent.config import parse_listen

log = logging.getLogger("llmgw.agent.metrics")

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# IB data counters count 4-byte words (the InfiniBand spec's PortXmitData);
# RoCE netdev counters count bytes.
DATA_COUNTERS = {"tx": (("port_xmit_data", 4), ("tx_bytes", 1)), "rx": (("port_rcv_data", 4), ("rx_bytes", 1))}
# The port's error counters, as the doctor reads them.
ERROR_COUNTERS = wire.IB_ERROR_COUNTERS
# Wear counters (-1 = not reported for this card) and flags, by metric.
WEAR_COUNTERS = (
    ("llmgw_node_gpu_pcie_replays_total", "PCIe replays of the card.", (), ("pcie_replays",)),
    ("llmgw_node_gpu_xid_errors_total", "XID errors the kernel logged for the card.", (), ("xid_errors",)),
)
WEAR_LABELLED = (
    (
        "llmgw_node_gpu_retired_pages",
        "Memory pages the card retired, by cause.",
        "cause",
        (("sbe", "retired_pages_sbe"), ("dbe", "retired_pages_dbe")),
    ),
    (
        "llmgw_node_gpu_remapped_rows",
        "Memory rows the card remapped, by kind.",
        "kind",
        (("correctable", "remapped_rows_correctable"), ("uncorrectable", "remapped_rows_uncorrectable")),
    ),
    (
        "llmgw_node_gpu_nvlink_errors_total",
        "NVLink errors of the card, summed over its links, by kind.",
        "kind",
        (("crc", "nvlink_crc_errors"), ("replay", "nvlink_replay_errors"), ("recovery", "nvlink_recovery_errors")),
    ),
)
WEAR_FLAGS = (
    ("llmgw_node_gpu_retire_pending", "1 while a page retirement waits for a reset.", "retire_pending"),
    ("llmgw_node_gpu_remap_pending", "1 while a row remap waits for a reset.", "remap_pending"),
    ("llmgw_node_gpu_remap_failure", "1 when the card failed to remap a row (replace it).", "remap_failure"),
)


def _escape(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _number(value: float) -> str:
    if value == int(value) and abs(value) < 2**53:
        return str(int(value))
    return repr(float(value))


class _Writer:
    """The text exposition format, one family at a time."""

    def __init__(self) -> None:
        self.out: list[str] = []

    def family(self, name: str, kind: str, help_: str, samples: Iterable[tuple[dict[str, str], float]]) -> None:
        rows = list(samples)
        if not rows:
            return
        self.out.append(f"# HELP {name} {help_}\n# TYPE {name} {kind}\n")
        for labels, value in rows:
            inner = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
            self.out.append(f"{name}{{{inner}}} {_number(value)}\n" if inner else f"{name} {_number(value)}\n")

    def text(self) -> str:
        return "".join(self.out)


def render(hb: wire.Heartbeat | None, *, now: float) -> str:
    """This node's metrics in Prometheus' text format, from the agent's last heartbeat body.

    Before the first sample only `llmgw_node_sample_age_seconds` is absent and
    `llmgw_node_up` is 0, so an agent that cannot read its sensors is visible.
    """
    w = _Writer()
    w.family("llmgw_node_up", "gauge", "1 once the agent has read this node's sensors.", [({}, 0 if hb is None else 1)])
    if hb is None:
        return w.text()
    if hb.at is not None:
        w.family(
            "llmgw_node_sample_age_seconds",
            "gauge",
            "Seconds since the agent read the sensors served here.",
            [({}, round(max(now - hb.at, 0.0), 3))],
        )
    _load(w, hb.load)
    _gpus(w, hb.gpus or [])
    _ports(w, hb.ib_ports or [])
    _shards(w, hb)
    return w.text()


def _load(w: _Writer, load: wire.Load | None) -> None:
    if load is None:
        return
    w.family(
        "llmgw_node_cpu_utilization_ratio", "gauge", "Host CPU busy fraction, 0 to 1.", [({}, load.cpu_percent / 100)]
    )
    w.family("llmgw_node_memory_used_bytes", "gauge", "Host memory in use.", [({}, load.mem_used_bytes)])
    w.family("llmgw_node_memory_available_bytes", "gauge", "Host memory available.", [({}, load.mem_avail_bytes)])
    temps = [({"sensor": "cpu"}, load.cpu_temp_c), ({"sensor": "inlet"}, load.inlet_temp_c)]
    w.family("llmgw_node_temperature_celsius", "gauge", "Host temperatures.", [t for t in temps if t[1]])


def _gpus(w: _Writer, gpus: list[wire.GPUSensor]) -> None:
    def each(attr: str, scale: float = 1.0, *, keep: Callable[[float], bool] = bool):
        return [({"gpu": str(g.index)}, getattr(g, attr) * scale) for g in gpus if keep(getattr(g, attr))]

    def known(v: float) -> bool:
        return v >= 0

    w.family(
        "llmgw_node_gpu_utilization_ratio",
        "gauge",
        "GPU busy fraction, 0 to 1.",
        each("util_percent", 0.01, keep=known),
    )
    w.family(
        "llmgw_node_gpu_memory_utilization_ratio",
        "gauge",
        "GPU memory controller busy fraction, 0 to 1.",
        each("mem_util_percent", 0.01, keep=known),
    )
    w.family("llmgw_node_gpu_temperature_celsius", "gauge", "GPU core temperature.", each("temp_c"))
    w.family("llmgw_node_gpu_memory_temperature_celsius", "gauge", "GPU memory temperature.", each("memory_temp_c"))
    w.family("llmgw_node_gpu_power_watts", "gauge", "GPU power draw.", each("power_w"))
    w.family("llmgw_node_gpu_power_limit_watts", "gauge", "GPU power limit.", each("power_limit_w"))
    w.family("llmgw_node_gpu_memory_used_bytes", "gauge", "GPU memory in use.", each("memory_used_mb", 2**20))
    w.family("llmgw_node_gpu_memory_total_bytes", "gauge", "GPU memory.", each("memory_total_mb", 2**20))
    w.family("llmgw_node_gpu_sm_clock_hertz", "gauge", "GPU SM clock.", each("sm_clock_mhz", 1e6))
    w.family(
        "llmgw_node_gpu_ecc_uncorrected_errors_total",
        "counter",
        "Uncorrected ECC errors since the driver loaded.",
        each("ecc_uncorrected", keep=known),
    )
    w.family(
        "llmgw_node_gpu_throttled",
        "gauge",
        "1 for each reason the card is throttled now.",
        [({"gpu": str(g.index), "reason": r}, 1) for g in gpus for r in g.throttle],
    )
    worn = [g for g in gpus if g.wear is not None]
    for name, help_, _, (attr,) in WEAR_COUNTERS:
        rows = [({"gpu": str(g.index)}, getattr(g.wear, attr)) for g in worn if getattr(g.wear, attr) >= 0]
        w.family(name, "counter", help_, rows)
    for name, help_, label, kinds in WEAR_LABELLED:
        rows = [
            ({"gpu": str(g.index), label: kind}, getattr(g.wear, attr))
            for g in worn
            for kind, attr in kinds
            if getattr(g.wear, attr) >= 0
        ]
        w.family(name, "counter" if name.endswith("_total") else "gauge", help_, rows)
    for name, help_, attr in WEAR_FLAGS:
        w.family(name, "gauge", help_, [({"gpu": str(g.index)}, int(getattr(g.wear, attr))) for g in worn])
    w.family(
        "llmgw_node_gpu_last_xid",
        "gauge",
        "The last XID the kernel logged for the card (0: none).",
        [({"gpu": str(g.index)}, g.wear.last_xid) for g in worn if g.wear.xid_errors >= 0],
    )


def _port_labels(p: wire.IBPort) -> dict[str, str]:
    return {"hca": p.hca, "port": str(p.port)}


def _ports(w: _Writer, ports: list[wire.IBPort]) -> None:
    w.family(
        "llmgw_node_ib_port_active",
        "gauge",
        "1 when the InfiniBand/RoCE port is ACTIVE.",
        [(_port_labels(p), int("ACTIVE" in p.state.upper())) for p in ports],
    )
    w.family(
        "llmgw_node_ib_port_link_speed_bytes_per_second",
        "gauge",
        "The port's link rate.",
        [(_port_labels(p), p.rate_gbps * 1e9 / 8) for p in ports if p.rate_gbps],
    )
    data = []
    for p in ports:
        for direction, names in DATA_COUNTERS.items():
            for counter, scale in names:
                if counter in p.counters:
                    data.append((_port_labels(p) | {"direction": direction}, p.counters[counter] * scale))
                    break
    w.family("llmgw_node_ib_port_data_bytes_total", "counter", "Bytes through the port, as its counters say.", data)
    w.family(
        "llmgw_node_ib_port_errors_total",
        "counter",
        "The port's error counters as it reports them.",
        [(_port_labels(p) | {"counter": c}, p.counters[c]) for p in ports for c in ERROR_COUNTERS if c in p.counters],
    )


def _shards(w: _Writer, hb: wire.Heartbeat) -> None:
    w.family(
        "llmgw_node_shard_state",
        "gauge",
        "1 for each shard's current state, as the agent's supervisor sees it.",
        [({"shard": s.shard_id, "replica": s.replica_id, "state": str(s.state)}, 1) for s in hb.shards],
    )
    loads = (hb.load.shards if hb.load else {}) or {}
    w.family(
        "llmgw_node_shard_cpu_cores",
        "gauge",
        "CPU cores the shard's processes use.",
        [({"shard": k}, v.cpu_cores) for k, v in sorted(loads.items())],
    )
    w.family(
        "llmgw_node_shard_resident_bytes",
        "gauge",
        "Resident memory of the shard's processes.",
        [({"shard": k}, v.rss_bytes) for k, v in sorted(loads.items())],
    )


class Latest:
    """The last heartbeat body the agent built: what the endpoint serves, shared between threads."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._lock = threading.Lock()
        self._hb: wire.Heartbeat | None = None
        self.clock = clock

    def update(self, hb: wire.Heartbeat) -> None:
        """Keep `hb` as the sample to serve."""
        with self._lock:
            self._hb = hb

    def text(self) -> str:
        """The current sample in the text format."""
        with self._lock:
            hb = self._hb
        return render(hb, now=self.clock())


class MetricsServer:
    """The agent's /metrics on a thread of its own, so a slow scrape never delays a heartbeat."""

    def __init__(self, latest: Latest, *, listen: str, token: str = "", open_: bool = False) -> None:
        if not token and not open_:
            raise ValueError("metrics_listen needs metrics_token, or metrics_open: true to serve without one")
        host, port = parse_listen(listen)
        expected = f"Bearer {token}".encode() if token else b""

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path.split("?")[0] != "/metrics":
                    self._send(404, b"not found: the agent serves /metrics\n")
                    return
                given = (self.headers.get("Authorization") or "").encode()
                if expected and not hmac.compare_digest(given, expected):
                    self._send(401, b"a bearer token is required (metrics_token in agent.yaml)\n")
                    return
                self._send(200, latest.text().encode(), CONTENT_TYPE)

            def _send(self, code: int, body: bytes, ctype: str = "text/plain; charset=utf-8") -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                log.debug("metrics: " + format, *args)

        self.httpd = ThreadingHTTPServer((host, port), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="agent-metrics", daemon=True)

    @property
    def port(self) -> int:
        """The port it listens on (the one the kernel chose when agent.yaml said 0)."""
        return int(self.httpd.server_address[1])

    def start(self) -> MetricsServer:
        """Serve in the background."""
        self.thread.start()
        return self

    def close(self) -> None:
        """Stop serving and release the port."""
        self.httpd.shutdown()
        self.httpd.server_close()


def metrics_addr(server: MetricsServer | None, listen: str, mgmt_addr: str) -> str | None:
    """host:port for Prometheus to scrape, as registration reports it; None when nothing is served.

    An agent listening on every address is reached at its management address,
    the one the control plane already knows it by.
    """
    if server is None:
        return None
    host, _ = parse_listen(listen)
    if host in ("0.0.0.0", "::") and mgmt_addr:
        host = mgmt_addr
    return f"[{host}]:{server.port}" if ":" in host else f"{host}:{server.port}"
