"""Fabric rules: port keys, canonical subnet managers, physical fabrics, SM changes, scans."""

import datetime as dt

import pytest

import llmgw_wire as wire
from inventory import fabric
from inventory.models import FabricScan, SMChange

SM_A = "0x0002c90300a1b2c1"
SM_B = "0x0002c90300a1b2c2"


def ib(hca="mlx5_0", port=1, state="ACTIVE", sm=SM_A, sms=(), network="", link="InfiniBand"):
    return wire.IBPort(
        hca=hca,
        port=port,
        state=state,
        link_layer=link,
        sm_guid=sm,
        network=network,
        sms=[wire.SubnetManager(guid=g) for g in sms],
    )


def test_infiniband_key_is_the_master_sm():
    assert fabric.fabric_key(ib(sm="0x0002C90300A1B2C1")) == f"sm:{SM_A}"


def test_roce_key_is_the_ip_network():
    port = ib(link="Ethernet", sm="", network="10.20.0.0/24")
    assert fabric.fabric_key(port) == "roce:10.20.0.0/24"


def test_inactive_or_unknown_ports_have_no_key():
    assert fabric.fabric_key(ib(state="DOWN")) == ""
    assert fabric.fabric_key(ib(state="INIT")) == ""
    assert fabric.fabric_key(ib(sm="")) == ""
    assert fabric.fabric_key(ib(link="Ethernet", sm="", network="")) == ""


def test_sysfs_spelling_of_active_counts():
    assert fabric.fabric_key(ib(state="4: ACTIVE")) == f"sm:{SM_A}"


def test_canonical_sms_keep_one_key_through_a_failover():
    # Before the failover one port saw A as master and listed A and B; after
    # it, another port sees B as master. Both must name the fabric by A.
    before = ib("mlx5_0", sm=SM_A, sms=[SM_A, SM_B])
    after = ib("mlx5_1", sm=SM_B)
    canon = fabric.canonical_sms([before, after])
    assert canon == {SM_A: SM_A, SM_B: SM_A}
    assert fabric.fabric_key(after, canon) == f"sm:{SM_A}"
    assert fabric.fabric_key(before, canon) == f"sm:{SM_A}"


def test_canonical_sms_keep_separate_fabrics_apart():
    other = "0x0002c90300ffff01"
    canon = fabric.canonical_sms([ib(sm=SM_B, sms=[SM_B, SM_A]), ib("mlx5_1", sm=other)])
    assert canon == {SM_A: SM_A, SM_B: SM_A, other: other}


def test_canonical_sms_union_is_transitive_and_lowest_wins():
    c = "0x0002c90300a1b2c0"
    canon = fabric.canonical_sms([ib(sm=SM_B, sms=[SM_B]), ib(sm=SM_A, sms=[SM_A, SM_B]), ib(sm=c, sms=[c, SM_B])])
    assert canon == {SM_A: c, SM_B: c, c: c}


def test_physical_fabric_known_consistent():
    ports = [ib("mlx5_0"), ib("mlx5_1"), ib("mlx5_9", sm="0x0002c90300ffff01")]
    pf = fabric.physical_fabric(["mlx5_0", "mlx5_1"], ports)
    assert (pf.key, pf.known, pf.consistent) == (f"sm:{SM_A}", True, True)


def test_physical_fabric_unknown_when_no_adapter_says():
    pf = fabric.physical_fabric(["mlx5_0"], [ib("mlx5_0", state="DOWN")])
    assert (pf.key, pf.known, pf.consistent) == ("", False, True)


def test_declared_fabric_cabled_to_two_is_reported():
    other = "0x0002c90300ffff01"
    pf = fabric.physical_fabric(["mlx5_0", "mlx5_1"], [ib("mlx5_0"), ib("mlx5_1", sm=other)])
    assert (pf.key, pf.known, pf.consistent) == ("", True, False)
    assert pf.keys == (f"sm:{SM_A}", f"sm:{other}")


@pytest.mark.django_db
def test_sm_changes_are_capped_at_500(now, settings):
    assert settings.LLMGW_SM_CHANGES_KEPT == 500
    for i in range(503):
        fabric.record_sm_change(
            at=now + dt.timedelta(seconds=i), node_id="n1", port="mlx5_0/1", from_guid=SM_A, to_guid=SM_B
        )
    assert SMChange.objects.count() == 500
    assert SMChange.objects.order_by("at").first().at == now + dt.timedelta(seconds=3)


@pytest.mark.django_db
def test_failed_scan_keeps_the_last_good_text(now):
    fabric.set_scan(key="sm:x", at=now, node_id="n1", port="mlx5_0/1", output="Switch 36 ...", error="", took_s=2.5)
    later = now + dt.timedelta(minutes=10)
    fabric.set_scan(
        key="sm:x", at=later, node_id="n2", port="mlx5_1/1", output="", error="ibnetdiscover: timeout", took_s=120.0
    )
    scan = FabricScan.objects.get(key="sm:x")
    assert (scan.output, scan.error, scan.at, scan.output_at, scan.node_id) == (
        "Switch 36 ...",
        "ibnetdiscover: timeout",
        later,
        now,
        "n2",
    )
    # A good scan after that replaces text and clears the error.
    fabric.set_scan(key="sm:x", at=later, node_id="n1", port="mlx5_0/1", output="Switch 36 v2", error="", took_s=2.0)
    scan.refresh_from_db()
    assert (scan.output, scan.error) == ("Switch 36 v2", "")


@pytest.mark.django_db
def test_first_scan_failing_keeps_the_error(now):
    fabric.set_scan(key="sm:y", at=now, node_id="n1", port="p", output="", error="no such device", took_s=0.1)
    scan = FabricScan.objects.get(key="sm:y")
    assert (scan.output, scan.error, scan.output_at) == ("", "no such device", None)


def test_key_is_never_derived_from_the_gid_prefix():
    # OpenSM's default prefix is fe80:: everywhere: matching it proves nothing.
    no_sm = wire.IBPort(hca="mlx5_0", port=1, state="ACTIVE", link_layer="InfiniBand", gid_prefix="fe80:0000:0000:0000")
    assert fabric.fabric_key(no_sm) == ""
    a = ib(hca="mlx5_0", sm=SM_A).model_copy(update={"gid_prefix": "fe80:0000:0000:0000"})
    b = ib(hca="mlx5_1", sm=SM_B).model_copy(update={"gid_prefix": "fe80:0000:0000:0000"})
    assert (fabric.fabric_key(a), fabric.fabric_key(b)) == (f"sm:{SM_A}", f"sm:{SM_B}")
    assert fabric.physical_fabric(["mlx5_0", "mlx5_1"], [a, b]).consistent is False
