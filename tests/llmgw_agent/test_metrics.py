"""The agent's own metrics endpoint, served from recorded hardware (fixture mode) and scraped over HTTP."""

from __future__ import annotations

import random
import shutil

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

import llmgw_wire as wire
from llmgw_agent import config as config_mod
from llmgw_agent.loop import Agent, DiscoveryProbe
from llmgw_agent.metrics import Latest, MetricsServer, render

from .conftest import PROFILES


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


@pytest.fixture
def hgx_agent(tmp_path):
    root = tmp_path / "hgx-h100"
    shutil.copytree(PROFILES / "hgx-h100", root)
    cfg = config_mod.parse(
        {
            "control_plane": "http://cp.test",
            "join_token": "join",
            "node_id": "gpu-01",
            "state_dir": str(tmp_path / "state"),
            "metrics_listen": "127.0.0.1:0",
            "metrics_token": "scrape-secret",
        }
    )
    agent = Agent(cfg, probe=DiscoveryProbe(root=root, model_dirs=[]), rng=random.Random(7), clock=lambda: 1000.0)
    yield agent
    agent.close()


def test_a_running_agent_serves_its_recorded_sensors_wear_and_ports(hgx_agent):
    url = f"http://127.0.0.1:{hgx_agent.metrics_server.port}/metrics"
    before = httpx.get(url, headers={"Authorization": "Bearer scrape-secret"})
    assert before.status_code == 200
    assert _samples(before.text) == {("llmgw_node_up", ()): 0.0}

    hgx_agent.heartbeat_body()
    r = httpx.get(url, headers={"Authorization": "Bearer scrape-secret"})
    assert r.status_code == 200
    assert r.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    got = _samples(r.text)
    assert got[("llmgw_node_up", ())] == 1.0
    assert got[("llmgw_node_sample_age_seconds", ())] == 0.0
    assert got[("llmgw_node_memory_used_bytes", ())] == 70173682688
    # The recorded nvidia-smi: card 0 at 30 C drawing 100.89 W, of an 80 GB H100.
    assert got[("llmgw_node_gpu_temperature_celsius", (("gpu", "0"),))] == 30.0
    assert got[("llmgw_node_gpu_power_watts", (("gpu", "0"),))] == 100.89
    assert got[("llmgw_node_gpu_memory_total_bytes", (("gpu", "0"),))] == 85520809984
    # Wear: PCIe replays on cards 0, 5 and 6; card 6's one XID was 31.
    replays = {dict(k[1])["gpu"]: v for k, v in got.items() if k[0] == "llmgw_node_gpu_pcie_replays_total"}
    assert replays == {"0": 7, "1": 0, "2": 0, "3": 0, "4": 0, "5": 4, "6": 15, "7": 0}
    assert got[("llmgw_node_gpu_xid_errors_total", (("gpu", "6"),))] == 1
    assert got[("llmgw_node_gpu_last_xid", (("gpu", "6"),))] == 31
    # Ports: eight active 400 Gb/s adapters, mlx5_5's link went down once.
    active = [dict(k[1])["hca"] for k, v in got.items() if k[0] == "llmgw_node_ib_port_active" and v == 1]
    assert active == [f"mlx5_{i}" for i in range(8)]
    speed = (("hca", "mlx5_0"), ("port", "1"))
    assert got[("llmgw_node_ib_port_link_speed_bytes_per_second", speed)] == 50e9
    downs = {
        dict(k[1])["hca"]: v
        for k, v in got.items()
        if k[0] == "llmgw_node_ib_port_errors_total" and dict(k[1])["counter"] == "link_downed"
    }
    assert downs == {f"mlx5_{i}": (1 if i == 5 else 0) for i in range(8)}
    # No node label: Prometheus attaches the service discovery's labels to the target.
    assert all("node" not in dict(labels) for _, labels in got)


def test_the_endpoint_refuses_a_scrape_without_the_token(hgx_agent):
    url = f"http://127.0.0.1:{hgx_agent.metrics_server.port}/metrics"
    assert httpx.get(url).status_code == 401
    assert httpx.get(url, headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert (
        httpx.get(url.replace("/metrics", "/other"), headers={"Authorization": "Bearer scrape-secret"}).status_code
        == 404
    )


def test_registration_reports_the_address_prometheus_scrapes(hgx_agent):
    assert hgx_agent.registration().metrics_addr == f"127.0.0.1:{hgx_agent.metrics_server.port}"


def test_an_agent_without_metrics_listen_serves_nothing_and_says_so(tmp_path):
    cfg = config_mod.parse({"control_plane": "http://cp.test", "node_id": "n1", "state_dir": str(tmp_path)})
    agent = Agent(cfg, probe=DiscoveryProbe(root=PROFILES / "cpu-only", model_dirs=[]))
    try:
        assert agent.metrics_server is None
        assert agent.registration().metrics_addr is None
    finally:
        agent.close()


def test_an_open_endpoint_needs_no_token(tmp_path):
    latest = Latest(clock=lambda: 50.0)
    latest.update(wire.Heartbeat(node_id="n1", at=48.5))
    server = MetricsServer(latest, listen="127.0.0.1:0", open_=True).start()
    try:
        r = httpx.get(f"http://127.0.0.1:{server.port}/metrics")
        assert r.status_code == 200
        assert _samples(r.text) == {("llmgw_node_up", ()): 1.0, ("llmgw_node_sample_age_seconds", ()): 1.5}
    finally:
        server.close()


def test_port_data_counters_are_bytes_and_shards_carry_their_load():
    hb = wire.Heartbeat(
        node_id="n1",
        at=10.0,
        load=wire.Load(
            cpu_percent=25.0, shards={"s-1": wire.ShardLoad(cpu_cores=1.5, rss_bytes=2048)}, inlet_temp_c=21.0
        ),
        ib_ports=[
            # IB data counters count 4-byte words; a RoCE netdev counts bytes.
            wire.IBPort(hca="mlx5_0", port=1, state="4: ACTIVE", counters={"port_xmit_data": 10, "port_rcv_data": 3}),
            wire.IBPort(hca="mlx5_9", port=1, state="1: DOWN", counters={"tx_bytes": 7, "rx_bytes": 9}),
        ],
        shards=[wire.ShardStatus(shard_id="s-1", replica_id="r-1", state=wire.ShardState.READY)],
    )
    got = _samples(render(hb, now=10.0))
    data = {
        (dict(k[1])["hca"], dict(k[1])["direction"]): v
        for k, v in got.items()
        if k[0].startswith("llmgw_node_ib_port_data")
    }
    assert data == {("mlx5_0", "tx"): 40, ("mlx5_0", "rx"): 12, ("mlx5_9", "tx"): 7, ("mlx5_9", "rx"): 9}
    assert got[("llmgw_node_ib_port_active", (("hca", "mlx5_9"), ("port", "1")))] == 0
    assert got[("llmgw_node_cpu_utilization_ratio", ())] == 0.25
    assert got[("llmgw_node_temperature_celsius", (("sensor", "inlet"),))] == 21.0
    assert ("llmgw_node_temperature_celsius", (("sensor", "cpu"),)) not in got
    assert got[("llmgw_node_shard_cpu_cores", (("shard", "s-1"),))] == 1.5
    assert got[("llmgw_node_shard_resident_bytes", (("shard", "s-1"),))] == 2048
    assert got[("llmgw_node_shard_state", (("replica", "r-1"), ("shard", "s-1"), ("state", "ready")))] == 1
