"""The wire schema's own rules: what an older or newer peer's message reads as."""

from agents import wire


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
