"""The simulated fleet's preparation: per-node copies with their own GPUs, domains and fabrics."""

from __future__ import annotations

import re
from pathlib import Path

from llmgw_agent import config as config_mod
from llmgw_sim.simulate import ZERO_UUID, Fleet, derive_fabrics, domain_uuid, in_nvlink_domain, prepare_node

SMI = """\
GPU 00000008:01:00.0
    GPU UUID                              : GPU-1a2b3c4d-0000-1111-2222-333344445555
    Fabric
        State                             : Completed
        Status                            : Success
        ClusterUUID                       : 8f1e7d33-9a0b-4c2d-8e5f-112233445566
        CliqueId                          : 32766
GPU 00000009:01:00.0
    GPU UUID                              : GPU-1a2b3c4d-0000-1111-2222-333344445556
    Fabric
        State                             : Completed
        Status                            : Success
        ClusterUUID                       : 8f1e7d33-9a0b-4c2d-8e5f-112233445566
        CliqueId                          : 32766
"""


def _port(root: Path, hca: str, *, layer: str, rate: str, sm_lid: str) -> None:
    p = root / "sys" / "class" / "infiniband" / hca / "ports" / "1"
    p.mkdir(parents=True)
    (p / "link_layer").write_text(layer + "\n")
    (p / "rate").write_text(rate + "\n")
    (p / "sm_lid").write_text(sm_lid + "\n")


def _profiles(tmp_path: Path) -> Path:
    profiles = tmp_path / "profiles"
    nvl = profiles / "tray"
    (nvl / "cmd").mkdir(parents=True)
    (nvl / "cmd" / "nvidia-smi_-q.txt").write_text(SMI)
    _port(nvl, "mlx5_0", layer="InfiniBand", rate="400 Gb/sec (4X NDR)", sm_lid="0x1")
    _port(nvl, "mlx5_1", layer="InfiniBand", rate="400 Gb/sec (4X NDR)", sm_lid="0x1")
    _port(nvl, "mlx5_2", layer="InfiniBand", rate="200 Gb/sec (4X HDR)", sm_lid="0x1")
    # Same LID, another subnet manager: the recorded sminfo tells them apart.
    (nvl / "cmd" / "sminfo_-C_mlx5_2_-P_1.txt").write_text(
        "sminfo: sm lid 1 sm guid 0x2c90200259201, activity count 6881 priority 0 state 3 SMINFO_MASTER\n"
    )
    _port(nvl, "mlx5_3", layer="Ethernet", rate="100 Gb/sec (4X EDR)", sm_lid="0x0")
    hgx = profiles / "hgx"
    (hgx / "cmd").mkdir(parents=True)
    (hgx / "cmd" / "nvidia-smi_-q.txt").write_text(SMI.replace("8f1e7d33-9a0b-4c2d-8e5f-112233445566", ZERO_UUID))
    return profiles


def test_fabrics_from_the_profile_adapters(tmp_path):
    assert derive_fabrics(_profiles(tmp_path) / "tray") == [
        {"name": "ib-a", "hcas": ["mlx5_0", "mlx5_1"], "rate_gbps": 400},
        {"name": "ib-b", "hcas": ["mlx5_2"], "rate_gbps": 200},
        {"name": "roce-a", "hcas": ["mlx5_3"], "rate_gbps": 100},
    ]


def test_nodes_get_their_own_gpus_and_domain(tmp_path):
    profiles = _profiles(tmp_path)
    token = tmp_path / "tok"
    token.write_text("secret")
    nodes = [
        prepare_node(
            index=i,
            profile="tray",
            workdir=tmp_path / "fleet",
            control_plane="http://127.0.0.1:8000",
            token_file=token,
            domain_size=2,
            profiles_dir=profiles,
        )
        for i in range(3)
    ]
    assert [n.node_id for n in nodes] == ["sim-tray-00", "sim-tray-01", "sim-tray-02"]
    assert [n.domain for n in nodes] == [domain_uuid("tray", 0), domain_uuid("tray", 0), domain_uuid("tray", 1)]
    uuids = []
    for n in nodes:
        text = (n.root / "cmd" / "nvidia-smi_-q.txt").read_text()
        assert re.findall(r"ClusterUUID\s+: (\S+)", text) == [n.domain, n.domain]
        uuids += re.findall(r"GPU-[0-9a-f-]{36}", text)
    assert len(set(uuids)) == 6
    # The shipped profile itself is untouched.
    assert "8f1e7d33-9a0b-4c2d-8e5f-112233445566" in (profiles / "tray" / "cmd" / "nvidia-smi_-q.txt").read_text()
    # Its agent.yaml is a real file the agent loads.
    cfg = config_mod.load(nodes[2].config)
    assert (cfg.node_id, cfg.token(), cfg.labels) == ("sim-tray-02", "secret", {"simulated": "true", "profile": "tray"})
    assert [f.name for f in cfg.fabrics] == ["ib-a", "ib-b", "roce-a"]


def test_single_machine_nvswitch_is_no_domain(tmp_path):
    profiles = _profiles(tmp_path)
    assert not in_nvlink_domain(profiles / "hgx")
    node = prepare_node(
        index=0,
        profile="hgx",
        workdir=tmp_path / "f",
        control_plane="http://cp",
        token_file=tmp_path / "t",
        profiles_dir=profiles,
    )
    assert node.domain == ""
    assert ZERO_UUID in (node.root / "cmd" / "nvidia-smi_-q.txt").read_text()


def test_a_mixed_fleet_fills_each_domain_with_trays_of_one_profile(tmp_path):
    # Round-robin over two profiles: the trays are the 1st, 3rd and 5th nodes,
    # and still two of them share each domain.
    fleet = Fleet(
        nodes=6,
        control_plane="http://127.0.0.1:1",
        join_token="t",
        workdir=tmp_path / "work",
        profiles=["tray", "hgx"],
        domain_size=2,
        profiles_dir=_profiles(tmp_path),
    )
    by_profile = {p: [n.domain for n in fleet.nodes if n.profile == p] for p in ("tray", "hgx")}
    assert by_profile == {
        "tray": [domain_uuid("tray", 0), domain_uuid("tray", 0), domain_uuid("tray", 1)],
        "hgx": ["", "", ""],
    }


def test_a_fabrics_rate_is_its_slowest_ports(tmp_path):
    _port(tmp_path, "mlx5_0", layer="InfiniBand", rate="400 Gb/sec (4X NDR)", sm_lid="0x1")
    _port(tmp_path, "mlx5_1", layer="InfiniBand", rate="200 Gb/sec (4X HDR)", sm_lid="0x1")
    assert derive_fabrics(tmp_path) == [{"name": "ib-a", "hcas": ["mlx5_0", "mlx5_1"], "rate_gbps": 200}]
