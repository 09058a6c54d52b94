from llmgw_agent.discovery import subnet


def test_sminfo(fixture_text):
    sm = subnet.parse_sminfo(fixture_text("sminfo/master-lid37-prio14.txt"))
    assert (sm.guid, sm.lid, sm.priority, sm.state) == ("0x7cfe90030016aef1", 37, 14, "MASTER")
    sm = subnet.parse_sminfo(fixture_text("sminfo/master-lid2-prio0.txt"))
    assert (sm.guid, sm.lid, sm.priority) == ("0x0002c90200259201", 2, 0)
    assert subnet.parse_sminfo(fixture_text("sminfo/query-failed.txt")) is None
    assert subnet.parse_sminfo(fixture_text("sminfo/no-state.txt")) is None


def test_saquery_lists_master_first(fixture_text):
    sms = subnet.parse_saquery_sms(fixture_text("saquery/fabric-a.txt"))
    assert [(s.guid, s.lid, s.priority, s.state) for s in sms] == [
        ("0x7cfe90030016aef1", 37, 14, "MASTER"),
        ("0x0021283a8620b0f0", 25, 13, "STANDBY"),
    ]
