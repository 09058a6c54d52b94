"""A heartbeat re-runs the slow reads (dmesg, sminfo, saquery, nvidia-imex-ctl) at most once a minute."""

import shutil

import pytest

import llmgw_wire as wire
from llmgw_agent import discovery
from llmgw_agent.discovery import SLOW_READ_INTERVAL, sample
from llmgw_agent.discovery.tools import recording_name

from .conftest import PROFILES

SLOW_TOOLS = {"dmesg", "sminfo", "saquery", "nvidia-imex-ctl"}
ALL_SMINFO = [f"sminfo_-C_mlx5_{i}_-P_1" for i in range(8)]
BOTH_SAQUERY = ["saquery_-s_-C_mlx5_0_-P_1", "saquery_-s_-C_mlx5_4_-P_1"]
FIRST_SLOW = sorted(["dmesg", "nvidia-imex-ctl_-N", *ALL_SMINFO, *BOTH_SAQUERY])
FATAL_XID = "[ 9000.000001] NVRM: Xid (PCI:0000:ba:00): 79, pid=0, GPU has fallen off the bus.\n"


@pytest.fixture
def slow_calls(monkeypatch):
    """The slow tools run since the last look, by recording name, sorted; each look starts afresh."""
    calls: list[str] = []
    real = discovery.run_tool

    def counting(argv, **kw):
        if argv[0] in SLOW_TOOLS:
            calls.append(recording_name(argv))
        return real(argv, **kw)

    monkeypatch.setattr(discovery, "run_tool", counting)

    def take() -> list[str]:
        out = sorted(calls)
        calls.clear()
        return out

    return take


def _profile(tmp_path, name):
    root = tmp_path / name
    shutil.copytree(PROFILES / name, root)
    return root


def _sm(port: wire.IBPort) -> tuple:
    return (port.hca, port.sm_guid, port.sm_lid, port.sm_priority, port.sm_state, port.sm_error, len(port.sms))


def _port_dir(root, hca):
    return root / "sys" / "class" / "infiniband" / hca / "ports" / "1"


def test_slow_reads_wait_a_minute_and_are_carried_between(tmp_path, slow_calls):
    root = _profile(tmp_path, "hgx-h100")
    first = sample(root=root, now=1000.0)
    assert slow_calls() == FIRST_SLOW
    assert [_sm(p) for p in first.ib_ports][::4] == [
        ("mlx5_0", "0x7cfe90030016aef1", 37, 14, "MASTER", "", 2),
        ("mlx5_4", "0x0002c90200259201", 2, 0, "MASTER", "", 1),
    ]
    # A failover on the first fabric, and a fatal XID on card 6, both recorded after the first read.
    for hca in range(4):
        (root / "cmd" / f"sminfo_-C_mlx5_{hca}_-P_1.txt").write_text(
            "sminfo: sm lid 38 sm guid 0x7cfe90030016aef2, activity count 5 priority 13 state 3 SMINFO_MASTER\n"
        )
    with (root / "cmd" / "dmesg.txt").open("a") as f:
        f.write(FATAL_XID)

    second = sample(root=root, previous=first, now=1000.0 + SLOW_READ_INTERVAL - 0.1)
    assert slow_calls() == []
    assert [_sm(p) for p in second.ib_ports] == [_sm(p) for p in first.ib_ports]
    assert [p.sms for p in second.ib_ports] == [p.sms for p in first.ib_ports]
    assert (second.gpus[6].wear.xid_errors, second.gpus[6].wear.last_xid, second.gpus[6].problems) == (1, 31, [])
    assert second.slow is first.slow

    third = sample(root=root, previous=second, now=1000.0 + SLOW_READ_INTERVAL)
    assert slow_calls() == FIRST_SLOW
    assert [_sm(p) for p in third.ib_ports][:5] == [
        ("mlx5_0", "0x7cfe90030016aef2", 38, 13, "MASTER", "", 2),
        ("mlx5_1", "0x7cfe90030016aef2", 38, 13, "MASTER", "", 0),
        ("mlx5_2", "0x7cfe90030016aef2", 38, 13, "MASTER", "", 0),
        ("mlx5_3", "0x7cfe90030016aef2", 38, 13, "MASTER", "", 0),
        ("mlx5_4", "0x0002c90200259201", 2, 0, "MASTER", "", 1),
    ]
    assert (third.gpus[6].wear.xid_errors, third.gpus[6].wear.last_xid) == (2, 79)
    assert third.gpus[6].problems == ["XID 79: GPU has fallen off the bus: reboot the node"]

    # The next interval counts from the third read, not the first.
    sample(root=root, previous=third, now=1000.0 + 2 * SLOW_READ_INTERVAL - 0.1)
    assert slow_calls() == []


def test_cheap_reads_stay_per_heartbeat(tmp_path, slow_calls):
    root = _profile(tmp_path, "hgx-h100")
    first = sample(root=root, now=1000.0)
    (_port_dir(root, "mlx5_5") / "counters" / "symbol_error").write_text("77\n")
    (root / "proc" / "loadavg").write_text("9.50 8.25 7.00 3/1200 4242\n")
    second = sample(root=root, previous=first, now=1005.0)
    assert slow_calls() == FIRST_SLOW
    assert (second.ib_ports[5].counters["symbol_error"], second.load.load1) == (77, 9.5)


def test_a_port_that_goes_down_loses_its_subnet_manager_at_once(tmp_path, slow_calls):
    root = _profile(tmp_path, "hgx-h100")
    first = sample(root=root, now=1000.0)
    slow_calls()
    state = _port_dir(root, "mlx5_1") / "state"
    state.write_text("1: DOWN\n")

    down = sample(root=root, previous=first, now=1005.0)
    # The active ports changed: every slow read runs again, on the seven still up.
    assert slow_calls() == sorted(["dmesg", "nvidia-imex-ctl_-N", *ALL_SMINFO[:1], *ALL_SMINFO[2:], *BOTH_SAQUERY])
    assert _sm(down.ib_ports[1]) == ("mlx5_1", "", 0, 0, "", "", 0)
    assert _sm(down.ib_ports[2]) == ("mlx5_2", "0x7cfe90030016aef1", 37, 14, "MASTER", "", 0)

    # Up again, recabled to the other fabric: read at once, not a minute later. It is
    # now the first port to see that fabric's master, so it asks for the fabric's list.
    (root / "cmd" / "sminfo_-C_mlx5_1_-P_1.txt").write_text(
        "sminfo: sm lid 2 sm guid 0x0002c90200259201, activity count 6 priority 0 state 3 SMINFO_MASTER\n"
    )
    shutil.copy(root / "cmd" / "saquery_-s_-C_mlx5_4_-P_1.txt", root / "cmd" / "saquery_-s_-C_mlx5_1_-P_1.txt")
    state.write_text("4: ACTIVE\n")
    up = sample(root=root, previous=down, now=1010.0)
    assert slow_calls() == sorted(
        ["dmesg", "nvidia-imex-ctl_-N", *ALL_SMINFO, *BOTH_SAQUERY[:1], "saquery_-s_-C_mlx5_1_-P_1"]
    )
    assert [_sm(p) for p in up.ib_ports][1::3] == [
        ("mlx5_1", "0x0002c90200259201", 2, 0, "MASTER", "", 1),
        ("mlx5_4", "0x0002c90200259201", 2, 0, "MASTER", "", 0),
        ("mlx5_7", "0x0002c90200259201", 2, 0, "MASTER", "", 0),
    ]


def test_a_link_flap_between_heartbeats_reads_again(tmp_path, slow_calls):
    root = _profile(tmp_path, "hgx-h100")
    first = sample(root=root, now=1000.0)
    slow_calls()
    # Down and up between two heartbeats: still active, but the link-down count moved.
    (_port_dir(root, "mlx5_3") / "counters" / "link_downed").write_text("1\n")
    (root / "cmd" / "sminfo_-C_mlx5_3_-P_1.err").write_text("ibwarn: mad_rpc: _do_madrpc failed")
    second = sample(root=root, previous=first, now=1005.0)
    assert slow_calls() == FIRST_SLOW
    assert _sm(second.ib_ports[3]) == ("mlx5_3", "", 0, 0, "", "sminfo: ibwarn: mad_rpc: _do_madrpc failed", 0)


def test_imex_and_its_problems_are_carried_between_reads(tmp_path, slow_calls):
    root = _profile(tmp_path, "gb200-nvl")
    first = sample(root=root, now=1000.0)
    assert slow_calls() == ["dmesg", "nvidia-imex-ctl_-N", "saquery_-s_-C_mlx5_0_-P_1", "sminfo_-C_mlx5_0_-P_1"]
    assert (first.imex, first.problems) == (wire.IMEX(state="UP", channels=1, detail="18/18 nodes ready"), [])
    (root / "cmd" / "nvidia-imex-ctl_-N.err").write_text("connection refused")

    second = sample(root=root, previous=first, now=1030.0)
    assert slow_calls() == []
    assert (second.imex, second.problems) == (first.imex, [])

    third = sample(root=root, previous=second, now=1000.0 + SLOW_READ_INTERVAL)
    assert slow_calls() == ["dmesg", "nvidia-imex-ctl_-N", "saquery_-s_-C_mlx5_0_-P_1", "sminfo_-C_mlx5_0_-P_1"]
    assert third.imex == wire.IMEX(state="DOWN", channels=1, detail="nvidia-imex-ctl: connection refused")
    assert third.problems == ["IMEX: nvidia-imex-ctl: connection refused"]
    # A problem carried from the slow read is reported again at the next heartbeat, not once.
    fourth = sample(root=root, previous=third, now=1000.0 + SLOW_READ_INTERVAL + 5)
    assert (slow_calls(), fourth.problems) == ([], ["IMEX: nvidia-imex-ctl: connection refused"])


def test_a_clock_set_back_reads_again(tmp_path, slow_calls):
    root = _profile(tmp_path, "hgx-h100")
    first = sample(root=root, now=1000.0)
    slow_calls()
    sample(root=root, previous=first, now=900.0)
    assert slow_calls() == FIRST_SLOW
