from llmgw_agent.discovery import health, imex


def test_imex_domain_up(fixture_text):
    s = imex.parse_imex_ctl(fixture_text("imex/aws-18-nodes-up.txt"))
    assert s.domain_state == "UP"
    assert len(s.nodes) == 18 and s.nodes["172.31.56.47"] == "READY"
    assert s.detail() == "18/18 nodes ready"
    assert imex.count_channels(["channel0", "channel1", "README"]) == 2


def test_kernel_xids(fixture_text):
    xids = health.parse_kernel_xids(fixture_text("dmesg/xid.txt"))
    assert [(x.pci_bus_id, x.xid) for x in xids] == [
        ("0000:01:00", 32),
        ("0000:01:00", 32),
        ("0000:01:00", 79),
        ("0000:3b:00", 79),
    ]
    assert health.same_pci("0000:01:00", "00000000:01:00.0")
    assert not health.same_pci("0000:01:00", "00000008:01:00.0")


def test_xid_rules():
    assert [x for x in (13, 31, 43, 45, 68, 48, 64, 79) if health.xid_is_fatal(x)] == [48, 64, 79]
    assert health.xid_meaning(79) == "GPU has fallen off the bus: reboot the node"
    assert health.xid_meaning(64) == "row-remap failure: reset the GPU, then send it for service"


def test_wear_limits():
    kw = dict(remap_failure=False, remap_pending=False, retire_pending=False)
    assert health.wear_problems(**kw, retired_pages=60, replays_per_minute=8) == []
    assert health.wear_problems(**kw, retired_pages=61, replays_per_minute=9) == [
        "61 retired pages, past the limit of 60: replace the card",
        "9 PCIe replays a minute, past 8: check the slot and riser",
    ]
