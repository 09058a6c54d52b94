"""End to end: the real control plane and three real agent processes in fixture mode.

Needs the agent endpoints (agents.credentials, /api/v1/agent/...), hardware
discovery (llmgw_agent.discovery) and the recorded node profiles; it is
skipped where one of them is not part of the tree.
"""

from __future__ import annotations

import datetime as dt
import subprocess

import pytest

from llmgw_sim.simulate import Fleet, domain_uuid, shipped_profiles

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

PROFILES = ["gb200-nvl", "gb200-nvl", "hgx-h100"]


def test_three_agents_register_with_gpus_fabrics_domain_and_imex(live_server, tmp_path):
    credentials = pytest.importorskip("agents.credentials")
    pytest.importorskip("llmgw_agent.discovery")
    missing = sorted(set(PROFILES) - set(shipped_profiles()))
    if missing:
        pytest.skip(f"node profiles not shipped: {missing}")
    from inventory.models import Node

    now = dt.datetime.now(dt.UTC)
    _, secret = credentials.create_join_token(name="e2e", expires_at=now + dt.timedelta(hours=1), max_uses=10, now=now)
    fleet = Fleet(
        nodes=3,
        control_plane=live_server.url,
        join_token=secret,
        workdir=tmp_path / "fleet",
        profiles=PROFILES,
        domain_size=2,
        heartbeat_interval=1,
    )
    fleet.start(extra_args=["--once"])
    try:
        for n in fleet.nodes:
            try:
                rc = n.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                rc = None
            assert rc == 0, (n.dir / "agent.log").read_text()[-3000:]
    finally:
        fleet.stop(grace_s=2)

    nodes = {n.id: n for n in Node.objects.prefetch_related("gpus", "fabrics")}
    assert sorted(nodes) == ["sim-gb200-nvl-00", "sim-gb200-nvl-01", "sim-hgx-h100-02"]
    tray, tray2, hgx = nodes["sim-gb200-nvl-00"], nodes["sim-gb200-nvl-01"], nodes["sim-hgx-h100-02"]

    # GPUs as recorded, each node with its own UUIDs.
    assert tray.gpus.count() == 4
    assert {g.name for g in tray.gpus.all()} == {"NVIDIA GB200"}
    assert hgx.gpus.count() == 8
    assert all("H100" in g.name for g in hgx.gpus.all())
    uuids = [g.uuid for n in nodes.values() for g in n.gpus.all()]
    assert len(uuids) == len(set(uuids)) == 16

    # The two trays share one simulated NVLink domain; a single machine's NVSwitch is none.
    assert tray.nvlink_domain.split("/")[0] == domain_uuid("gb200-nvl", 0)
    assert tray2.nvlink_domain == tray.nvlink_domain
    assert hgx.nvlink_domain == ""

    # IMEX on the trays; fabrics as declared in each node's agent.yaml.
    assert tray.imex_up()
    assert [f.name for f in tray.fabrics.all()] == [f["name"] for f in fleet.nodes[0].fabrics()]
    assert sorted(f.name for f in hgx.fabrics.all()) == ["ib-a", "ib-b"]  # two subnet managers, two fabrics
    assert tray.labels["profile"] == "gb200-nvl"
