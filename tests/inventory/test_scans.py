"""Fabric scans: the ibnetdiscover parser on recorded output, and who is asked to scan."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest

import llmgw_wire as wire
from inventory import fabric, ibnetdiscover, outbox, scans
from inventory.models import Command, FabricScan
from inventory.nodes import change_state
from tests.factories import make_node
from tests.inventory.ibports import SM_A, SM_B, SM_OTHER, ib_port, put

RECORDED = Path(__file__).resolve().parent.parent / "fixtures" / "hardware" / "ibnetdiscover"


def recorded(name: str) -> str:
    return (RECORDED / name).read_text()


# --- parser -----------------------------------------------------------------


def test_parses_a_real_qdr_fabric():
    m = ibnetdiscover.parse_ibnetdiscover(recorded("x5-qdr-2020.topo"))
    assert (m.switches, m.cas, m.routers) == (11, 89, 0)
    assert len(m.nodes) == 100
    assert len(m.node_guids) == 100
    # 89 adapter ports and the 11 switches' port 0.
    assert len(m.port_guids) == 100
    assert m.links == 318
    first = m.nodes[0]
    assert first == ibnetdiscover.ScanNode(
        kind="switch",
        guid="0x0008f10500200b50",
        ports=36,
        description="Voltaire 4036 - 36 QDR ports switch",
        port_guids=("0x0008f10500200b50",),
    )
    last = m.nodes[-1]
    assert last == ibnetdiscover.ScanNode(
        kind="ca",
        guid="0x0002c90300080e84",
        ports=1,
        description="MT25408 ConnectX Mellanox Technologies",
        port_guids=("0x0002c90300080e85",),
    )


def test_every_adapter_port_of_the_real_map_is_also_seen_from_its_switch():
    m = ibnetdiscover.parse_ibnetdiscover(recorded("x5-qdr-2020.topo"))
    ca_ports = {g for n in m.nodes if n.kind == "ca" for g in n.port_guids}
    assert len(ca_ports) == 89
    text = recorded("x5-qdr-2020.topo")
    for g in ca_ports:
        assert f"({int(g, 16):x})" in text


def test_parses_the_manual_example_with_a_two_port_adapter():
    m = ibnetdiscover.parse_ibnetdiscover(recorded("voltaire-isr9024.topo"))
    assert (m.switches, m.cas) == (2, 4)
    dual = next(n for n in m.nodes if n.guid == "0x0008f10403960558")
    assert dual.port_guids == ("0x0008f1040396055a", "0x0008f10403960559")
    assert dual.ports == 2
    assert m.links == 14


def test_has_port_compares_sysfs_spellings():
    m = ibnetdiscover.parse_ibnetdiscover(recorded("x5-qdr-2020.topo"))
    # sysfs writes port GUIDs as four colon-separated groups.
    assert m.has_port(port_guid="78e7:d103:0022:97fd") is True
    assert m.has_port(port_guid="0x78E7D103002297FD") is True
    assert m.has_port(port_guid="78e7:d103:0022:0000") is False
    # Without a port GUID the node GUID decides.
    assert m.has_port(node_guid="0x78e7d103002297fc") is True
    assert m.has_port(node_guid="0x78e7d10300000000") is False
    assert m.has_port() is None


def test_sharp_aggregation_nodes_are_counted_apart_from_hosts_adapters():
    m = ibnetdiscover.parse_ibnetdiscover(recorded("sharp-an-hdr-excerpt.topo"))
    assert (m.cas, m.aggregation_nodes, m.switches) == (1, 1, 0)
    an = next(n for n in m.nodes if n.aggregation_node)
    assert (an.guid, an.description) == ("0x0002c90000020cf9", "Mellanox Technologies Aggregation Node")
    # The real QDR map has none, and keeps its 89 adapters.
    assert ibnetdiscover.parse_ibnetdiscover(recorded("x5-qdr-2020.topo")).aggregation_nodes == 0


def lone_ca_map() -> str:
    """The recorded HDR host adapter's block without its link line: a CA that sees only itself."""
    return "\n".join(line for line in recorded("sharp-an-hdr-excerpt.topo").splitlines()[7:] if "S-0002" not in line)


def test_a_lone_ca_without_port_guid_lines_matches_by_node_guid():
    m = ibnetdiscover.parse_ibnetdiscover(lone_ca_map())
    assert (m.cas, m.links, m.port_guids) == (1, 0, frozenset())
    # sysfs gives both GUIDs; the map has only the node's.
    assert m.has_port(port_guid="0002:c900:0001:7dfe", node_guid="0002:c900:0001:7dfd") is True
    assert m.has_port(port_guid="0002:c900:0001:7dfe", node_guid="0002:c900:0001:0000") is False
    # A CA the map shows with its port GUID is still matched by that port only.
    full = ibnetdiscover.parse_ibnetdiscover(recorded("sharp-an-hdr-excerpt.topo"))
    assert full.has_port(port_guid="0002:c900:0001:0000", node_guid="0002:c900:0001:7dfd") is False
    assert full.has_port(port_guid="0002:c900:0001:7dfe", node_guid="0002:c900:0001:7dfd") is True


def test_garbage_and_empty_text_give_an_empty_map():
    assert ibnetdiscover.parse_ibnetdiscover("") == ibnetdiscover.FabricMap()
    m = ibnetdiscover.parse_ibnetdiscover(
        "ibwarn: [1234] mad_rpc_open_port: can't open UMAD port\nsrc/ibnetdisc.c:123\n"
    )
    assert (m.switches, m.cas, m.links) == (0, 0, 0)


# --- planning ---------------------------------------------------------------


def p(**kw) -> wire.IBPort:
    return wire.IBPort.model_validate(ib_port(**kw))


def test_plan_one_port_per_fabric_preferring_ready_nodes():
    ports = {
        "a-cordoned": [p(hca="mlx5_0")],
        "b-ready": [p(hca="mlx5_1"), p(hca="mlx5_0"), p(hca="mlx5_2", sm_guid=SM_OTHER)],
        "c-ready": [p(hca="mlx5_0")],
    }
    states = {"a-cordoned": "cordoned", "b-ready": "ready", "c-ready": "ready"}
    orders = scans.plan_scans(states, ports)
    assert orders == [
        scans.ScanOrder(key=f"sm:{SM_A}", node_id="b-ready", hca="mlx5_0", port=1),
        scans.ScanOrder(key=f"sm:{SM_OTHER}", node_id="b-ready", hca="mlx5_2", port=1),
    ]


def test_plan_falls_back_to_a_cordoned_node_and_skips_unknown_nodes():
    ports = {"a": [p()], "gone": [p(hca="mlx5_9", sm_guid=SM_OTHER)]}
    orders = scans.plan_scans({"a": "cordoned"}, ports)
    assert orders == [scans.ScanOrder(key=f"sm:{SM_A}", node_id="a", hca="mlx5_0", port=1)]


def test_plan_skips_roce_down_ports_and_busy_fabrics():
    ports = {
        "a": [
            p(hca="mlx5_0", link_layer="Ethernet", sm_guid="", network="10.0.0.0/24"),
            p(hca="mlx5_1", state="1: DOWN"),
            p(hca="mlx5_2", sm_guid=SM_OTHER),
        ]
    }
    assert scans.plan_scans({"a": "ready"}, ports, busy=[f"sm:{SM_OTHER}"]) == []


def test_plan_keeps_one_fabric_through_a_failover():
    # One port still sees A (and lists A and B), another already sees B: one fabric, one scan.
    ports = {"a": [p(hca="mlx5_0", sms=[{"guid": SM_A}, {"guid": SM_B}])], "b": [p(hca="mlx5_0", sm_guid=SM_B)]}
    orders = scans.plan_scans({"a": "ready", "b": "ready"}, ports)
    assert orders == [scans.ScanOrder(key=f"sm:{SM_A}", node_id="a", hca="mlx5_0", port=1)]


# --- scheduling through the command queue -----------------------------------


@pytest.fixture
def two_nodes(db, now):
    for node_id in ("node-a", "node-b"):
        make_node(node_id, now=now, gpus=0)
        put(node_id, now=now, ports=[ib_port()])


def scan_commands() -> list[tuple[str, dict]]:
    return [(c.node_id, c.payload) for c in Command.objects.filter(kind="scan_fabric").order_by("created_at")]


def test_schedule_sends_one_scan_per_fabric_and_not_twice(two_nodes, now):
    orders = scans.schedule_fabric_scans(now=now)
    assert orders == [scans.ScanOrder(key=f"sm:{SM_A}", node_id="node-a", hca="mlx5_0", port=1)]
    assert scan_commands() == [
        (
            "node-a",
            {"kind": "scan_fabric", "key": f"sm:{SM_A}", "hca": "mlx5_0", "port": 1, "timeout_s": 120.0},
        )
    ]
    # Still unacknowledged and recent: not asked again.
    assert scans.schedule_fabric_scans(now=now + dt.timedelta(minutes=10)) == []
    assert len(scan_commands()) == 1


def test_schedule_asks_again_once_acknowledged(two_nodes, now):
    scans.schedule_fabric_scans(now=now)
    [cmd] = outbox.pending("node-a", now=now)
    outbox.acknowledge("node-a", [cmd.id], now=now + dt.timedelta(seconds=5))
    later = now + dt.timedelta(minutes=10)
    assert len(scans.schedule_fabric_scans(now=later)) == 1
    assert Command.objects.filter(kind="scan_fabric", acked_at__isnull=True).count() == 1


def test_schedule_replaces_a_stale_unacknowledged_command(two_nodes, now):
    scans.schedule_fabric_scans(now=now)
    old = Command.objects.get(kind="scan_fabric")
    later = now + dt.timedelta(seconds=600 + 120 + 1)
    put("node-a", now=later, ports=[ib_port()])
    put("node-b", now=later, ports=[ib_port()])
    assert len(scans.schedule_fabric_scans(now=later)) == 1
    remaining = list(Command.objects.filter(kind="scan_fabric"))
    assert len(remaining) == 1
    assert remaining[0].id != old.id
    assert remaining[0].created_at == later


def test_schedule_skips_unreachable_nodes(two_nodes, now):
    change_state("node-a", "unreachable", now=now)
    orders = scans.schedule_fabric_scans(now=now)
    assert [o.node_id for o in orders] == ["node-b"]


def test_a_failed_scan_keeps_the_last_good_map(two_nodes, now):
    [order] = scans.schedule_fabric_scans(now=now)
    text = recorded("voltaire-isr9024.topo")
    port = scans.port_label(order.hca, order.port)
    fabric.set_scan(key=order.key, at=now, node_id=order.node_id, port=port, output=text, error="", took_s=1.5)
    later = now + dt.timedelta(minutes=10)
    fabric.set_scan(
        key=order.key,
        at=later,
        node_id=order.node_id,
        port=port,
        output="",
        error="ibnetdiscover timed out",
        took_s=120,
    )
    scan = FabricScan.objects.get(key=order.key)
    assert (scan.error, scan.at, scan.output_at, scan.took_s) == ("ibnetdiscover timed out", later, now, 120.0)
    m = ibnetdiscover.parse_ibnetdiscover(scan.output)
    assert (m.switches, m.cas) == (2, 4)


# --- ports read from telemetry ---------------------------------------------------

PORT_FIELDS = ("hca", "port", "state", "link_layer", "rate_gbps", "counters", "node_guid", "port_guid", "sm_guid")


def test_ports_of_reads_stored_ports_as_the_wire_model_would():
    stored = ib_port("mlx5_3", 2, counters={"symbol_error": 4}, sm_error="") | {"extra": "ignored"}
    [p] = scans.ports_of({"ib_ports": [stored]})
    assert isinstance(p, scans.Port)
    model = wire.IBPort.model_validate(stored)
    assert {f: getattr(p, f) for f in (*PORT_FIELDS, "sm_error", "network", "sms")} == {
        f: getattr(model, f) for f in (*PORT_FIELDS, "sm_error", "network", "sms")
    }


def test_ports_of_validates_unusual_entries_and_skips_bad_ones():
    coerced = ib_port() | {"port": "1"}
    listed = ib_port(sms=[{"guid": SM_A, "state": "master"}])
    bad = ib_port() | {"port": 999}
    ports = scans.ports_of({"ib_ports": [coerced, listed, bad, "junk", {"port": 1}]})
    assert [type(p) for p in ports] == [wire.IBPort, wire.IBPort]
    assert [p.port for p in ports] == [1, 1]
    assert ports[1].sms[0].guid == SM_A
