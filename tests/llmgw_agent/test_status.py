"""Status when it changes, a lease otherwise: the thresholds, exactly, and the gate's decisions interval by interval."""

from __future__ import annotations

import pytest

import llmgw_wire as wire
from llmgw import settings as project_settings
from llmgw_agent import status
from llmgw_agent.status import StatusGate, gpu_change, load_change, port_change, rate_change, status_change


def gpu(**kw) -> wire.GPUSensor:
    base = {
        "index": 0,
        "temp_c": 60.0,
        "memory_temp_c": 70.0,
        "power_w": 400.0,
        "power_limit_w": 700.0,
        "util_percent": 50.0,
        "mem_util_percent": 30.0,
        "memory_used_mb": 40000.0,
        "memory_total_mb": 80000.0,
        "sm_clock_mhz": 1980.0,
        "wear": {"xid_errors": 0, "retired_pages_sbe": 0},
    }
    return wire.GPUSensor.model_validate({**base, **kw})


def port(**kw) -> wire.IBPort:
    counters = {"port_xmit_data": 1000, "port_rcv_data": 2000, "symbol_error": 0, "link_downed": 0}
    counters.update(kw.pop("counters", {}))
    base = {"hca": "mlx5_0", "port": 1, "state": "4: ACTIVE", "rate_gbps": 400, "sm_guid": "0x1", "counters": counters}
    return wire.IBPort.model_validate({**base, **kw})


def load(**kw) -> wire.Load:
    base = {
        "cpu_percent": 30.0,
        "cpu_count": 64,
        "load1": 10.0,
        "mem_used_bytes": 100 * 2**30,
        "mem_avail_bytes": 900 * 2**30,
        "cpu_temp_c": 50.0,
        "cpu_power_w": 200.0,
        "inlet_temp_c": 25.0,
        "shards": {"s1": {"cpu_cores": 2.0, "rss_bytes": 8 * 2**30}},
    }
    return wire.Load.model_validate({**base, **kw})


def hb(at: float = 0.0, **kw) -> wire.Heartbeat:
    base = {
        "node_id": "node-a",
        "at": at,
        "load": load().model_dump(),
        "gpus": [gpu().model_dump()],
        "ib_ports": [port().model_dump()],
        "shards": [{"shard_id": "s1", "replica_id": "r1", "state": "ready", "http_port": 8000}],
        "engine_installs": [{"engine": "vllm", "version": "0.11.0", "state": "ready"}],
        "imex": {"state": "UP", "channels": 2048},
    }
    return wire.Heartbeat.model_validate({**base, **kw})


# --- the thresholds, case by case --------------------------------------------


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"temp_c": 64.9}, ""),
        ({"temp_c": 65.0}, "temperature"),
        ({"temp_c": 55.0}, "temperature"),
        ({"memory_temp_c": 75.0}, "temperature"),
        ({"power_w": 439.0}, ""),
        ({"power_w": 440.0}, "power"),
        ({"power_w": 360.0}, "power"),
        ({"power_limit_w": 600.0}, "power"),
        ({"util_percent": 59.9}, ""),
        ({"util_percent": 60.0}, "utilisation"),
        ({"mem_util_percent": 20.0}, "utilisation"),
        # 5 % of an 80 GB card: 4,000 MB.
        ({"memory_used_mb": 43999.0}, ""),
        ({"memory_used_mb": 44000.0}, "memory"),
        ({"memory_total_mb": 81559.0}, "memory"),
        # Any new error or wear, however small.
        ({"ecc_uncorrected": 1.0}, "errors"),
        ({"wear": {"xid_errors": 1, "retired_pages_sbe": 0}}, "errors"),
        ({"wear": {"xid_errors": 0, "retired_pages_sbe": 0, "remap_pending": True}}, "errors"),
        ({"throttle": ["hw_slowdown"]}, "throttle or problems"),
        ({"problems": ["nvidia-smi timed out"]}, "throttle or problems"),
        ({"sm_clock_mhz": 1600.0}, ""),
        ({"sm_clock_mhz": 1584.0}, "clock"),
    ],
)
def test_gpu_thresholds(change, why):
    assert gpu_change(gpu(), gpu(**change)) == why


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"cpu_percent": 39.9}, ""),
        ({"cpu_percent": 40.0}, "cpu"),
        ({"cpu_count": 32}, "cpu"),
        # 5 % of 1,000 GiB: 50 GiB.
        ({"mem_used_bytes": 149 * 2**30, "mem_avail_bytes": 851 * 2**30}, ""),
        ({"mem_used_bytes": 150 * 2**30, "mem_avail_bytes": 850 * 2**30}, "memory"),
        ({"cpu_temp_c": 54.0}, ""),
        ({"cpu_temp_c": 55.0}, "temperature"),
        ({"inlet_temp_c": 30.0}, "temperature"),
        ({"cpu_power_w": 219.0}, ""),
        ({"cpu_power_w": 220.0}, "power"),
        ({"load1": 11.9}, ""),
        ({"load1": 12.0}, "load average"),
        ({"shards": {}}, "engines"),
        ({"shards": {"s1": {"cpu_cores": 2.3, "rss_bytes": 8 * 2**30}}}, ""),
        ({"shards": {"s1": {"cpu_cores": 2.5, "rss_bytes": 8 * 2**30}}}, "engine load"),
        ({"shards": {"s1": {"cpu_cores": 2.0, "rss_bytes": 9 * 2**30}}}, "engine load"),
    ],
)
def test_host_thresholds(change, why):
    assert load_change(load(), load(**change)) == why


def test_host_load_appearing_or_vanishing_is_a_change():
    assert load_change(None, load()) == "load reported"
    assert load_change(load(), None) == "load reported"
    assert load_change(None, None) == ""


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"counters": {"port_xmit_data": 10**12}}, ""),
        ({"counters": {"symbol_error": 1}}, "port errors"),
        ({"counters": {"link_downed": 1}}, "port errors"),
        ({"counters": {"port_rcv_errors": 1}}, "port errors"),
        ({"state": "1: DOWN"}, "port state"),
        ({"phys_state": "3: Disabled"}, "port state"),
        ({"rate_gbps": 200}, "port state"),
        ({"sm_guid": "0x2"}, "port state"),
    ],
)
def test_port_thresholds(change, why):
    assert port_change(port(), port(**change)) == why


@pytest.mark.parametrize(
    ("old", "new", "changed"),
    [
        ((100e9, 100e9), (119e9, 100e9), False),
        ((100e9, 100e9), (120e9, 100e9), True),
        ((100e9, 100e9), (100e9, 80e9), True),
        # Below 1 Gbit/s an idle port's chatter is not a change, whatever its ratio.
        ((1e6, 1e6), (9e8, 1e6), False),
        ((0.0, 0.0), (1e9, 0.0), True),
        (None, (1e9, 0.0), False),
    ],
)
def test_rate_thresholds(old, new, changed):
    assert rate_change(old, new) is changed


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"shards": [{"shard_id": "s1", "replica_id": "r1", "state": "draining", "http_port": 8000}]}, "shards"),
        ({"shards": [{"shard_id": "s1", "replica_id": "r1", "state": "loading", "http_port": 8000}]}, "shards"),
        ({"shards": [{"shard_id": "s1", "replica_id": "r1", "state": "ready", "http_port": 8001}]}, "shards"),
        ({"shards": []}, "shards"),
        ({"engine_installs": [{"engine": "vllm", "version": "0.12.0", "state": "ready"}]}, "engine installs"),
        ({"imex": {"state": "DOWN", "channels": 2048}}, "imex"),
        ({"gpus": []}, "gpus"),
        ({"gpus": None}, "gpus"),
        ({"ib_ports": [port(port=2).model_dump()]}, "ports"),
        ({"gpus": [gpu(temp_c=70.0).model_dump()]}, "gpu 0 temperature"),
        ({"ib_ports": [port(counters={"symbol_error": 3}).model_dump()]}, "mlx5_0/1 port errors"),
        ({"load": load(cpu_percent=90.0).model_dump()}, "host cpu"),
        # Acks and the clock are not status.
        ({"acks": ["c1"], "at": 99.0}, ""),
    ],
)
def test_what_is_status(change, why):
    assert status_change(hb(), hb(**change)) == why


# --- the gate, interval by interval ----------------------------------------------


def accept(gate: StatusGate, body: wire.Heartbeat, now: float, **answer) -> wire.Lease | None:
    """One interval: ask the gate, and answer what it chose to send."""
    lease = gate.lease(body, now=now)
    if lease is None:
        gate.answered(body, wire.HeartbeatResponse(leases=answer.pop("leases", True)), now=now)
    else:
        gate.answered(lease, wire.LeaseResponse(**answer), now=now)
    return lease


def test_status_first_then_leases_then_the_floor():
    gate = StatusGate()
    assert accept(gate, hb(at=0.0), 0.0) is None
    assert gate.reason == "leases not offered"
    for t in (5.0, 10.0, 55.0):
        lease = accept(gate, hb(at=t, acks=["c1"]), t)
        assert lease == wire.Lease(node_id="node-a", at=t, acks=["c1"])
        assert len(lease.model_dump_json()) < 200
    assert accept(gate, hb(at=60.0), 60.0) is None
    assert gate.reason == "floor"
    assert accept(gate, hb(at=65.0), 65.0) is not None


def test_the_floor_is_the_reason_only_when_nothing_else_changed_and_only_then_routine():
    gate = StatusGate()
    accept(gate, hb(at=0.0), 0.0)
    assert accept(gate, hb(at=5.0), 5.0) is not None and not gate.routine()
    # Due at 60 s with a second shard ready: the change is the reason, and it is not routine.
    two = [{"shard_id": s, "replica_id": f"r{s}", "state": "ready", "http_port": 8000 + i} for i, s in enumerate("ab")]
    changed = hb(at=60.0, shards=two)
    assert gate.lease(changed, now=60.0) is None
    assert (gate.reason, gate.routine()) == ("shards", False)
    # Due with nothing changed: the floor, routine.
    assert gate.lease(hb(at=60.0), now=60.0) is None
    assert (gate.reason, gate.routine()) == ("floor", True)


def test_drift_adds_up_against_the_last_status_sent():
    gate = StatusGate()
    accept(gate, hb(at=0.0), 0.0)
    # One degree an interval: no single step crosses 5 °C, the sum does.
    sent = [accept(gate, hb(at=t, gpus=[gpu(temp_c=60.0 + t / 5).model_dump()]), t) is None for t in range(5, 30, 5)]
    assert sent == [False, False, False, False, True]
    assert gate.reason == "gpu 0 temperature"


def test_a_control_plane_without_leases_gets_full_heartbeats():
    gate = StatusGate()
    for t in (0.0, 5.0, 10.0):
        assert accept(gate, hb(at=t), t, leases=None) is None
        assert gate.reason == "leases not offered"


def test_a_lost_status_is_sent_at_once_and_again_is_bounded():
    gate = StatusGate()
    accept(gate, hb(at=0.0), 0.0)
    assert accept(gate, hb(at=5.0), 5.0, send_status=True, again=True) is not None
    assert gate.wait_s(5.0) == 0.0
    assert accept(gate, hb(at=5.1), 5.1) is None
    assert gate.reason == "asked"
    assert gate.wait_s(5.0) == 5.0
    # More commands than an answer carries: come back at once, but not forever.
    waits = []
    for k in range(status.MAX_AGAIN + 2):
        accept(gate, hb(at=6.0 + k), 6.0 + k, again=True)
        waits.append(gate.wait_s(5.0))
    assert waits == [0.0] * status.MAX_AGAIN + [5.0, 5.0]
    accept(gate, hb(at=20.0), 20.0)
    assert gate.wait_s(5.0) == 5.0


def test_a_starts_progress_goes_with_a_lease_and_its_ready_as_status():
    gate = StatusGate()
    accept(gate, hb(at=0.0, shards=[]), 0.0)
    started = {"shard_id": "s2", "replica_id": "r2", "http_port": 8001}
    # The StartShard arrived: the new shard starting, then loading, change nothing the control plane acts on.
    for k, state in enumerate(["starting", "loading", "loading"]):
        t = 5.0 * (k + 1)
        lease = gate.lease(hb(at=t, shards=[{**started, "state": state}]), now=t)
        assert lease is not None, state
        gate.answered(lease, wire.LeaseResponse(), now=t)
    # Ready (or failed) is what it waits for: sent as status, at once.
    assert gate.lease(hb(at=20.0, shards=[{**started, "state": "ready"}]), now=20.0) is None
    assert gate.reason == "shards"
    assert gate.lease(hb(at=20.0, shards=[{**started, "state": "failed", "reason": "exit 1"}]), now=20.0) is None


def test_an_unanswered_status_is_sent_again():
    gate = StatusGate()
    accept(gate, hb(at=0.0), 0.0)
    changed = hb(at=5.0, shards=[])
    assert gate.lease(changed, now=5.0) is None  # sent, but no answer came back
    assert gate.lease(hb(at=10.0, shards=[]), now=10.0) is None
    assert gate.reason == "shards"


def test_byte_rates_are_measured_between_heartbeats():
    gate = StatusGate()

    def at(t: float, gbps: float) -> wire.Heartbeat:
        words = int(gbps * 1e9 / 8 / 4 * t)  # port_xmit_data counts 4-octet words
        return hb(at=t, ib_ports=[port(counters={"port_xmit_data": words, "port_rcv_data": 0}).model_dump()])

    accept(gate, at(5.0, 100), 5.0)
    # The first rate measured is the baseline, not a change.
    assert accept(gate, at(10.0, 100), 10.0) is not None
    assert accept(gate, at(15.0, 100), 15.0) is not None
    # Traffic doubles from 100 to 200 Gbit/s.
    words_before = int(100e9 / 32 * 15.0)
    body = hb(at=20.0, ib_ports=[port(counters={"port_xmit_data": words_before + int(200e9 / 32 * 5)}).model_dump()])
    assert accept(gate, body, 20.0) is None
    assert gate.reason == "mlx5_0/1 rate"


def test_registration_starts_over():
    gate = StatusGate()
    accept(gate, hb(at=0.0), 0.0)
    assert accept(gate, hb(at=5.0), 5.0) is not None
    gate.reset()
    assert accept(gate, hb(at=10.0), 10.0) is None
    assert gate.reason == "leases not offered"


def test_the_floor_stays_under_the_control_planes_telemetry_ttl():
    # The default, as shipped.
    assert status.STATUS_FLOOR_S < project_settings.LLMGW_TELEMETRY_TTL
