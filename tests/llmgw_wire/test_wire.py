"""The wire schema's own rules: what an older or newer peer's message reads as."""

import pydantic
import pytest

import llmgw_wire as wire


def test_wear_counts_default_to_not_reported():
    w = wire.GPUWear()
    counts = (
        w.pcie_replays,
        w.retired_pages_sbe,
        w.retired_pages_dbe,
        w.remapped_rows_correctable,
        w.remapped_rows_uncorrectable,
        w.nvlink_crc_errors,
        w.nvlink_replay_errors,
        w.nvlink_recovery_errors,
        w.xid_errors,
    )
    assert counts == (-1,) * 9
    assert (w.retire_pending, w.remap_pending, w.remap_failure, w.last_xid) == (False, False, False, 0)


def test_an_unknown_shard_state_reads_as_failed():
    assert wire.shard_state_from_wire("hibernating") is wire.ShardState.FAILED
    assert wire.shard_state_from_wire("READY") is wire.ShardState.READY
    assert wire.ShardStatus(shard_id="s", state="warming").state is wire.ShardState.FAILED
    assert wire.RunningShard(replica_id="r", shard_id="s").state is wire.ShardState.FAILED


@pytest.mark.parametrize(
    ("addr", "ok"),
    [
        ("10.0.0.5:9400", True),
        ("gpu-a01.dc1.example:9400", True),
        ("[fd00::5]:9400", True),
        ("10.0.0.5", False),
        ("http://10.0.0.5:9400", False),
        ("10.0.0.5:9400/metrics", False),
        ("", False),
    ],
)
def test_metrics_addr_is_a_bare_scrape_target(addr, ok):
    body = {"node_id": "n1", "metrics_addr": addr}
    if ok:
        assert wire.Register.model_validate(body).metrics_addr == addr
    else:
        with pytest.raises(pydantic.ValidationError):
            wire.Register.model_validate(body)
    assert wire.Register.model_validate({"node_id": "n1"}).metrics_addr is None
