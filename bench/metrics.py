"""A /metrics scrape, the service discovery and the doctor at 1,000 and 10,000 nodes, in a throwaway database.

Each node has 8 GPUs joined to an NVLink domain, a declared fabric of 8
InfiniBand adapters with error counters, its telemetry in the cache as a
heartbeat leaves it, and an agent metrics endpoint; every fabric has a scan.
Measured, each several times (min / median / max, the machine being shared):
a full scrape through Django's URL routing (django-prometheus' metrics,
llmgw's families, the streamed text), plain and gzipped, within the doctor's
cache window (the steady state: Prometheus scrapes more often than the
window), past the window (the last results served and one refresh queued,
inventory/doctor_refresh.py) and with no results kept (an age of -1
written and one refresh queued: no check runs in a scrape); the
service-discovery document; the doctor's refresh as the worker runs it, full
and with nothing changed (bench/doctor.py measures it further); the doctor
alone; each with its SQL query count, body size and the Python memory one
scrape allocates at its peak. Target: under 1 s and a few
MB at 10,000 nodes.
"""

from __future__ import annotations

import gzip
import os
import statistics
import time
import tracemalloc

from bench.common import StatementCounter, scratch_database

SIZES = (1000, 10000)
RUNS = 5
GPUS = 8
PORTS = 8
FABRICS = 4
NODES_PER_DOMAIN = 18
SM_STANDBY = "0x0002c90300a1b2ff"


def _sm(fabric: int) -> str:
    return f"0x0002c90300a1b2{fabric + 1:02x}"


def _guid(node: int, hca: int, *, port: bool) -> str:
    return f"0xa088c203{node:06x}{hca:02x}{1 if port else 0:02x}"


def _port(node: int, hca: int) -> dict:
    import llmgw_wire as wire

    counters = {
        "symbol_error": node % 3,
        "link_downed": 0,
        "link_error_recovery": 0,
        "port_rcv_errors": 0,
        "port_rcv_remote_physical_errors": 0,
        "port_rcv_switch_relay_errors": 0,
        "port_xmit_discards": 5,
        "local_link_integrity_errors": 0,
        "excessive_buffer_overrun_errors": 0,
        "port_xmit_data": 10**12 + node,
        "port_rcv_data": 10**12 + hca,
        "port_xmit_packets": 10**9,
        "port_rcv_packets": 10**9,
    }
    p = {
        "hca": f"mlx5_{hca}",
        "port": 1,
        "state": "4: ACTIVE",
        "phys_state": "5: LinkUp",
        "rate_gbps": 400,
        "link_layer": "InfiniBand",
        "counters": counters,
        "node_guid": _guid(node, hca, port=False),
        "port_guid": _guid(node, hca, port=True),
        "gid_prefix": "fe80:0000:0000:0000",
        "sm_guid": _sm(node % FABRICS),
        "sm_lid": 1,
        "sm_priority": 15,
        "sm_state": "master",
    }
    if node < FABRICS and hca == 0:
        p["sms"] = [{"guid": _sm(node), "lid": 1, "priority": 15, "state": "master"}]
        p["sms"] += [{"guid": SM_STANDBY.replace("ff", f"f{node}"), "lid": 2, "priority": 14, "state": "standby"}]
    # Stored the way the heartbeat stores it: validated, dumped, with rates beside.
    return wire.IBPort.model_validate(p).model_dump(mode="json") | {"tx_bps": 1.5e10 + hca, "rx_bps": 1.2e10 + node}


def _scan_text(nodes: list[int], fabric: int) -> str:
    """An ibnetdiscover map of one fabric: a switch and every adapter port on it."""
    lines = [f"switchguid=0x{fabric + 1:016x}", f'Switch  64 "S-{fabric + 1:016x}"  # "leaf {fabric}" port 0 lid 1']
    for i, node in enumerate(nodes):
        for h in range(PORTS):
            lines.append(f'[{i % 64 + 1}]  "H-{_guid(node, h, port=False)[2:]}"[1]({_guid(node, h, port=True)[2:]})')
    for node in nodes:
        for h in range(PORTS):
            lines.append(f'Ca  1 "H-{_guid(node, h, port=False)[2:]}"  # "node-{node:05d} mlx5_{h}"')
            lines.append(f'[1]({_guid(node, h, port=True)[2:]})  "S-{fabric + 1:016x}"[1]  # lid 2 lmc 0')
    return "\n".join(lines) + "\n"


def _populate(count: int, now) -> list[str]:
    from django.core.cache import cache

    from inventory import telemetry
    from inventory.models import GPU, FabricAttachment, FabricScan, Node

    ids = [f"node-{i:05d}" for i in range(count)]
    Node.objects.bulk_create(
        [
            Node(
                id=n,
                mgmt_addr=f"10.1.{i // 256}.{i % 256}",
                metrics_addr=f"10.1.{i // 256}.{i % 256}:9400",
                state="ready",
                last_seen=now,
                imex_state="UP",
                imex_channels=1,
                nvlink_domain=f"dom-{i // NODES_PER_DOMAIN}",
            )
            for i, n in enumerate(ids)
        ],
        batch_size=2000,
    )
    GPU.objects.bulk_create(
        [
            GPU(
                node_id=n,
                index=g,
                name="NVIDIA GB200",
                gpu_class="GB200-186GB",
                fabric_state="Completed",
                fabric_status="Success",
                cluster_uuid=f"c1a5e7e2-7c9b-4d1a-9f1e-{i // NODES_PER_DOMAIN:012x}",
                clique_id="7",
                fabric_bandwidth="Full",
            )
            for i, n in enumerate(ids)
            for g in range(GPUS)
        ],
        batch_size=5000,
    )
    FabricAttachment.objects.bulk_create(
        [FabricAttachment(node_id=n, name="ib0", hcas=[f"mlx5_{h}" for h in range(PORTS)], rate_gbps=400) for n in ids],
        batch_size=5000,
    )
    for f in range(FABRICS):
        members = [i for i in range(count) if i % FABRICS == f]
        FabricScan.objects.create(
            key=f"sm:{_sm(f)}", at=now, output_at=now, node_id=ids[f], port="mlx5_0/1",
            output=_scan_text(members, f), took_s=2.0,
        )  # fmt: skip
    at = now.timestamp()
    sensors = [
        {"index": g, "util_percent": 50.0 + g, "temp_c": 60.0, "power_w": 700.0 + g, "memory_used_mb": 1000}
        for g in range(GPUS)
    ]
    cache.set_many(
        {
            telemetry.key(n): {
                "at": at,
                "agent_at": at + 0.2,
                "load": None,
                "gpus": sensors,
                "ib_ports": [_port(i, h) for h in range(PORTS)],
            }
            for i, n in enumerate(ids)
        }
    )
    return ids


def _timed(fn, connection, repeat: int = RUNS) -> tuple[list[float], int, object]:
    """Every run's seconds, the last run's query count and its value."""
    times, queries, value = [], 0, None
    for _ in range(repeat):
        with StatementCounter(connection) as q:
            started = time.perf_counter()
            value = fn()
            times.append(time.perf_counter() - started)
        queries = q.count
    return times, queries, value


def _spread(times: list[float]) -> str:
    return f"{min(times):.3f} / {statistics.median(times):.3f} / {max(times):.3f} s"


def _peak_mb(fn) -> float:
    """The most Python memory `fn` held at once beyond what was held before, in MB."""
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1] / 1e6
    finally:
        tracemalloc.stop()


def _forget(ids: list[str]) -> None:
    from django.core.cache import cache

    from inventory import doctor, doctor_refresh, telemetry

    cache.delete_many([telemetry.key(n) for n in ids] + [doctor.counter_key(n) for n in ids])
    doctor_refresh.forget()


def run() -> list[str]:
    import django

    django.setup()
    from django.conf import settings
    from django.core.cache import cache
    from django.db import connection
    from django.test import Client
    from django.test.utils import setup_test_environment
    from django.utils import timezone

    from inventory import doctor, doctor_refresh
    from inventory.models import FabricScan, Node

    sizes = [int(s) for s in os.environ.get("LLMGW_BENCH_METRICS_NODES", "").split(",") if s] or SIZES
    lines: list[str] = []
    window = settings.LLMGW_DOCTOR_CACHE
    with scratch_database("bench_metrics"):
        setup_test_environment()  # the test client's host, as the tests have it
        client = Client()
        for count in sizes:
            Node.objects.all().delete()
            FabricScan.objects.all().delete()
            now = timezone.now()
            ids = _populate(count, now)
            try:
                # The first scrape writes the doctor's counter baselines: warm up once.
                assert client.get("/metrics").status_code == 200

                def body(resp) -> bytes:
                    return b"".join(resp.streaming_content)

                def scrape(**headers):
                    return body(client.get("/metrics", headers=headers))

                def scrape_stale():
                    # Past the window, and no refresh queued yet: this scrape queues it.
                    doctor.forget_cached()
                    cache.delete(doctor_refresh.QUEUED_KEY)
                    return scrape()

                def scrape_unkept():
                    doctor_refresh.forget()
                    return scrape()

                # Within the doctor's window, as when Prometheus scrapes more often
                # than the window: one slow run on a busy machine must not let the
                # window lapse and put the doctor's checks into the next one.
                settings.LLMGW_DOCTOR_CACHE = 3600.0
                doctor.latest(now=timezone.now(), fresh=True)
                cached, q_cached, text = _timed(scrape, connection)
                zipped, _, packed = _timed(lambda: scrape(accept_encoding="gzip"), connection)
                assert gzip.decompress(packed).count(b"\n") > count
                peak = _peak_mb(scrape)
                settings.LLMGW_DOCTOR_CACHE = window
                stale, q_stale, _ = _timed(scrape_stale, connection)
                unkept, q_unkept, _ = _timed(scrape_unkept, connection, repeat=3)
                full, q_full, _ = _timed(lambda: doctor_refresh.refresh(full=True), connection, repeat=3)
                refresh, q_refresh, _ = _timed(doctor_refresh.refresh_doctor, connection, repeat=3)
                sd, q_sd, doc = _timed(lambda: client.get("/api/v1/prometheus/targets").content, connection)
                doc_runs, q_doc, results = _timed(lambda: doctor.run(now=timezone.now()), connection, repeat=3)
                verdicts = {str(r.result) for r in results}
            finally:
                _forget(ids)
            lines += [
                f"{count:,} nodes:",
                f"  /metrics (doctor cached): {_spread(cached)}, {q_cached} queries, {len(text) / 1e6:.2f} MB,"
                f" peak {peak:.0f} MB allocated",
                f"  /metrics gzipped: {_spread(zipped)}, {len(packed) / 1e6:.2f} MB",
                f"  /metrics when the doctor's results are past the window (the last ones served, one refresh"
                f" queued): {_spread(stale)}, {q_stale} queries",
                f"  /metrics with no doctor's results kept (age -1, one refresh queued): {_spread(unkept)},"
                f" {q_unkept} queries",
                f"  the doctor's refresh in full: {_spread(full)}, {q_full} queries",
                f"  the doctor's refresh (the worker's task), nothing changed: {_spread(refresh)}, {q_refresh} queries",
                f"  service discovery: {_spread(sd)}, {q_sd} queries, {len(doc) / 1e6:.2f} MB",
                f"  doctor alone: {_spread(doc_runs)}, {q_doc} queries (verdicts {sorted(verdicts)})",
            ]
    return lines
