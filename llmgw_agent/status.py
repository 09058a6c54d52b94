"""Status when it changes, a lease otherwise: what the agent sends each interval.

A full heartbeat of an 8-GPU node is about 9 KB of sensors, counters, shard
states and facts, and most of it says what the previous one said. Like a
Kubernetes kubelet, which renews its node Lease every 10 s and sends its
NodeStatus only when it changes (or every 5 minutes), the agent sends its
status when something changed beyond the thresholds below, when the control
plane asks for it (it lost its copy), and at least every STATUS_FLOOR_S; in
between, a lease (wire.Lease: the node id, the clock, the acks; under 200
bytes). The control plane keeps the last status and renews its time to live
with every lease (agents/lease.py).

Every threshold compares the sample with the last status the control plane
ACCEPTED, not with the previous sample: a slow drift (a card warming 1 °C a
minute) adds up and is sent once it crosses the threshold, instead of never.
A status whose answer did not come back was not accepted, so the next
interval sends status again.

The thresholds, and why each is what it is:

- Anything discrete, at once: the shards (their states, reasons, exit codes,
  ports: placement and the gateway act on them; but a start's progress,
  starting and loading, waits for the next status, see shards_change), the TCP ports listening on
  the node (the planner keeps shard ports off them), engine installs, IMEX, the
  GPUs' NVLink fabric state, a card or a port appearing or vanishing, a port's
  state, speed, identity or subnet manager, throttle reasons, problems, and
  any change of a GPU's wear (retired pages, remapped rows, XIDs: the doctor
  judges each increase).
- Error counters, any increase: an IB port's error counters
  (wire.IB_ERROR_COUNTERS) and uncorrected ECC errors. One new symbol error
  is what the doctor warns about; waiting for a threshold would hide it.
- Temperatures, ±TEMP_C (5 °C): a card's temperature wanders by a degree or
  two under steady load; five is the smallest step that means the load or the
  cooling changed, well below the 15-20 °C between a busy card and throttling.
- Power, ±POWER_FRACTION (10 %) of the last value: steady inference moves a
  card's draw by a few percent; a new workload or a throttle moves it by tens.
- Utilisation (GPU, GPU memory, host CPU), ±UTIL_POINTS (10 points):
  sampled utilisation jitters by several points from one second to the next.
- Memory in use, ±MEMORY_FRACTION (5 %) of the total: an engine's memory is
  allocated once at start and then stable; 5 % of an 80 GB card is 4 GB,
  the size of a model shard or a KV-cache resize.
- Port byte rates, ±RATE_FRACTION (20 %) of the last rate, above
  RATE_FLOOR_BPS (1 Gbit/s): traffic is bursty, and 20 % is a change in the
  workload rather than in the burst; below 1 Gbit/s a 400 Gbit/s port is idle
  and its management chatter jitters by far more than 20 %.
- Everything else (clocks, load averages, per-engine CPU and memory):
  ±20 % of the last value, or a floor where the value is small.

STATUS_FLOOR_S (60 s) is the status floor: at least that often the agent
and the control plane agree on the status it holds, and the floor stays
under the control plane's telemetry time to live (LLMGW_TELEMETRY_TTL, 120 s
by default), so the last status outlives a lost lease or two. Since every
threshold is measured against the status the control plane accepted, what
it holds is within every threshold of the truth whenever nothing is sent;
so a floor at which nothing moved past one goes as a lease carrying the
digest the control plane gave that status (HeartbeatResponse.status_digest,
wire.Lease.status_digest), not as the status again. The control plane checks
that it still holds that very status (a cache restored or failed over to a
replica behind holds another, or none) and renews it, or asks for the whole
one (send_status). A 9 KB status parsed, recorded and written to the cache
each minute per node became a lease: at 10,000 nodes that is 167 statuses a
second off the web tier, all bunched into one half-minute of every minute by
the join storm, where two cores were full. The trade-off: a reading below
every threshold may now be older than a minute (its node page says when its
status came), never further from the truth than a threshold.

A control plane that gives no digest (an older one), or a lease endpoint
that does not confirm one (LeaseResponse.status_confirmed None: an older
gateway), gets the whole status at the floor, as before. Such a status, with
nothing beyond a threshold, is routine: it asks the control plane's web tier
to serve every other request first (llmgw_wire/priority.py ROUTINE). A fleet
that joined within a minute sends its floors within the same minute of every
minute, and a shard's ready queued behind them waited seconds to be heard.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import llmgw_wire as wire
from llmgw_wire.shard_states import report_at_once

STATUS_FLOOR_S = 60.0
TEMP_C = 5.0
POWER_FRACTION = 0.10
UTIL_POINTS = 10.0
MEMORY_FRACTION = 0.05
RATE_FRACTION = 0.20
RATE_FLOOR_BPS = 1e9
OTHER_FRACTION = 0.20
# Consecutive "come back at once" answers followed before the interval is waited again:
# a control plane that keeps saying `again` must not turn the agent into a busy loop.
MAX_AGAIN = 4

# Cumulative byte counters and the bytes each unit counts (sysfs's port_*_data count 4-octet words).
TX_COUNTERS = (("port_xmit_data", 4), ("tx_bytes", 1))
RX_COUNTERS = (("port_rcv_data", 4), ("rx_bytes", 1))

# A port's fields that change only when something happened to it.
_PORT_FACTS = (
    "state",
    "phys_state",
    "rate_gbps",
    "link_layer",
    "node_guid",
    "port_guid",
    "gid_prefix",
    "sm_guid",
    "sm_lid",
    "sm_priority",
    "sm_state",
    "sm_error",
    "network",
    "netdev",
    "sms",
    "sms_error",
)


def _port_key(p: wire.IBPort) -> str:
    return f"{p.hca}/{p.port}"


def _beyond(old: float, new: float, *, absolute: float = 0.0, fraction: float = 0.0, floor: float = 0.0) -> bool:
    """Whether `new` moved from `old` by more than `absolute`, or by more than `fraction` of `old`.

    With a fraction, a move of less than `floor` never counts: a small
    value's relative jitter is large and means nothing.
    """
    delta = abs(new - old)
    if absolute and delta >= absolute:
        return True
    if fraction:
        return delta >= max(fraction * abs(old), floor) and (delta > 0)
    return False


def _counter(counters: Mapping[str, int], names: tuple[tuple[str, int], ...]) -> int | None:
    for name, unit in names:
        if name in counters:
            return counters[name] * unit
    return None


def _errors_rose(old: Mapping[str, int], new: Mapping[str, int]) -> bool:
    # Any move counts: an increase is a new error, a decrease a reset the doctor must re-baseline.
    return any(old.get(n) != new.get(n) for n in wire.IB_ERROR_COUNTERS if n in old or n in new)


def gpu_change(old: wire.GPUSensor, new: wire.GPUSensor) -> str:
    """What changed on a card beyond the thresholds, '' when nothing did."""
    if _beyond(old.temp_c, new.temp_c, absolute=TEMP_C) or _beyond(
        old.memory_temp_c, new.memory_temp_c, absolute=TEMP_C
    ):
        return "temperature"
    if _beyond(old.power_w, new.power_w, fraction=POWER_FRACTION, floor=1.0) or old.power_limit_w != new.power_limit_w:
        return "power"
    if _beyond(old.util_percent, new.util_percent, absolute=UTIL_POINTS) or _beyond(
        old.mem_util_percent, new.mem_util_percent, absolute=UTIL_POINTS
    ):
        return "utilisation"
    total = new.memory_total_mb or old.memory_total_mb
    if old.memory_total_mb != new.memory_total_mb or _beyond(
        old.memory_used_mb, new.memory_used_mb, absolute=max(1.0, MEMORY_FRACTION * total)
    ):
        return "memory"
    if new.ecc_uncorrected != old.ecc_uncorrected or old.wear != new.wear:
        return "errors"
    if sorted(old.throttle) != sorted(new.throttle) or old.problems != new.problems:
        return "throttle or problems"
    if _beyond(old.sm_clock_mhz, new.sm_clock_mhz, fraction=OTHER_FRACTION, floor=50.0):
        return "clock"
    return ""


def load_change(old: wire.Load | None, new: wire.Load | None) -> str:
    """What changed in the host's load beyond the thresholds, '' when nothing did."""
    if old is None or new is None:
        return "" if old is new else "load reported"
    if old.cpu_count != new.cpu_count or _beyond(old.cpu_percent, new.cpu_percent, absolute=UTIL_POINTS):
        return "cpu"
    total = (new.mem_used_bytes + new.mem_avail_bytes) or (old.mem_used_bytes + old.mem_avail_bytes)
    if _beyond(old.mem_used_bytes, new.mem_used_bytes, absolute=max(1.0, MEMORY_FRACTION * total)):
        return "memory"
    if _beyond(old.cpu_temp_c, new.cpu_temp_c, absolute=TEMP_C) or _beyond(
        old.inlet_temp_c, new.inlet_temp_c, absolute=TEMP_C
    ):
        return "temperature"
    if _beyond(old.cpu_power_w, new.cpu_power_w, fraction=POWER_FRACTION, floor=1.0):
        return "power"
    if _beyond(old.load1, new.load1, fraction=OTHER_FRACTION, floor=1.0):
        return "load average"
    if set(old.shards) != set(new.shards):
        return "engines"
    for sid, now_load in new.shards.items():
        before = old.shards[sid]
        if _beyond(before.cpu_cores, now_load.cpu_cores, fraction=OTHER_FRACTION, floor=0.5) or _beyond(
            before.rss_bytes, now_load.rss_bytes, fraction=MEMORY_FRACTION, floor=64 * 2**20
        ):
            return "engine load"
    return ""


def port_change(old: wire.IBPort, new: wire.IBPort) -> str:
    """What changed on a port (its rates aside), '' when nothing did."""
    if any(getattr(old, f) != getattr(new, f) for f in _PORT_FACTS):
        return "port state"
    if _errors_rose(old.counters, new.counters):
        return "port errors"
    return ""


def rate_change(old: tuple[float, float] | None, new: tuple[float, float] | None) -> bool:
    """Whether a port's (tx, rx) bit rates moved by more than RATE_FRACTION, above RATE_FLOOR_BPS."""
    if old is None or new is None:
        return False
    return any(_beyond(o, n, fraction=RATE_FRACTION, floor=RATE_FLOOR_BPS) for o, n in zip(old, new, strict=True))


def _by(items: Iterable[Any] | None, key: Callable[[Any], Any]) -> dict[Any, Any]:
    return {key(i): i for i in items or []}


_SHARD_FIELDS = ("replica_id", "reason", "exit_code", "http_port")


def shards_change(old: Sequence[wire.ShardStatus], new: Sequence[wire.ShardStatus]) -> bool:
    """Whether the shards' report changed in a way that is sent as status now, not with the next one.

    A start's progress (a new shard starting, then loading: llmgw_wire/shard_states.py
    report_at_once) goes with a lease, its StartShard's ack too; its ready, its end,
    anything else about it, and a shard gone from the report go as status. A thousand
    replicas started at once were two thousand statuses in seconds, and the control
    plane acts on none of the first thousand.
    """
    before = {s.shard_id: s for s in old}
    if set(before) - {s.shard_id for s in new}:
        return True
    for s in new:
        was = before.get(s.shard_id)
        if was is None:
            if report_at_once(None, str(s.state)):
                return True
            continue
        if any(getattr(was, f) != getattr(s, f) for f in _SHARD_FIELDS):
            return True
        if was.state != s.state and report_at_once(str(was.state), str(s.state)):
            return True
    return False


def status_change(
    old: wire.Heartbeat,
    new: wire.Heartbeat,
    *,
    old_rates: Mapping[str, tuple[float, float]] | None = None,
    new_rates: Mapping[str, tuple[float, float]] | None = None,
) -> str:
    """Why `new` must be sent as status, given `old` was the last one accepted; '' when a lease will do.

    The rates are each port's (tx, rx) bits a second at `old` and now.
    """
    if shards_change(old.shards, new.shards):
        return "shards"
    if new.engine_installs != old.engine_installs:
        return "engine installs"
    if new.imex != old.imex:
        return "imex"
    if new.listening_ports != old.listening_ports:
        return "listening ports"
    old_gpus, new_gpus = _by(old.gpus, lambda g: g.index), _by(new.gpus, lambda g: g.index)
    if set(old_gpus) != set(new_gpus) or (old.gpus is None) != (new.gpus is None):
        return "gpus"
    for index, g in new_gpus.items():
        why = gpu_change(old_gpus[index], g)
        if why:
            return f"gpu {index} {why}"
    old_ports, new_ports = _by(old.ib_ports, _port_key), _by(new.ib_ports, _port_key)
    if set(old_ports) != set(new_ports) or (old.ib_ports is None) != (new.ib_ports is None):
        return "ports"
    for key, p in new_ports.items():
        why = port_change(old_ports[key], p)
        if why:
            return f"{key} {why}"
        if rate_change((old_rates or {}).get(key), (new_rates or {}).get(key)):
            return f"{key} rate"
    why = load_change(old.load, new.load)
    return f"host {why}" if why else ""


class StatusGate:
    """Decides, interval by interval, whether the agent sends its status or a lease.

    The loop asks `lease(body)` for each heartbeat it has built: None means
    send the body (full status), a Lease means send that instead. It reports
    every answer with `answered`, and waits `wait_s(interval)` before the next.
    """

    def __init__(self, *, floor_s: float = STATUS_FLOOR_S) -> None:
        self.floor_s = floor_s
        self.reset()

    def reset(self) -> None:
        """Forget what the control plane holds: after a registration the next interval sends status.

        Leases wait until a heartbeat's answer says this control plane takes them.
        """
        self.supported = False
        self.last: wire.Heartbeat | None = None
        self.last_at = 0.0
        self.last_rates: dict[str, tuple[float, float]] = {}
        self.last_fabrics: list[wire.GPUFabricReport] | None = None
        # The digest the control plane gave the last status it accepted (None: it keeps none), and
        # whether a floor sent as that digest went unconfirmed (a control plane that does not check).
        self.digest: str | None = None
        self.digest_unconfirmed = False
        self.wanted = False
        self.again = False
        self._again_run = 0
        self._prev_counters: dict[str, tuple[int | None, int | None]] = {}
        self._prev_at: float | None = None
        self.rates: dict[str, tuple[float, float]] = {}
        self.reason = ""

    def _measure_rates(self, body: wire.Heartbeat, now: float) -> None:
        # Each port's bits a second since the previous heartbeat built (sent or not).
        at = body.at if body.at is not None else now
        counters = {
            _port_key(p): (_counter(p.counters, TX_COUNTERS), _counter(p.counters, RX_COUNTERS))
            for p in body.ib_ports or []
        }
        rates: dict[str, tuple[float, float]] = {}
        if self._prev_at is not None and at > self._prev_at:
            seconds = at - self._prev_at
            for key, (tx, rx) in counters.items():
                before = self._prev_counters.get(key)
                if before is None:
                    continue
                rates[key] = (_rate(tx, before[0], seconds), _rate(rx, before[1], seconds))
        self._prev_counters, self._prev_at, self.rates = counters, at, rates

    def why_status(self, body: wire.Heartbeat, *, now: float) -> str:
        """Why this interval sends status, '' when a lease will do."""
        if not self.supported:
            return "leases not offered"
        if self.last is None:
            return "first"
        if self.wanted:
            return "asked"
        if body.gpu_fabrics is not None and body.gpu_fabrics != self.last_fabrics:
            return "gpu fabrics"
        why = status_change(self.last, body, old_rates=self.last_rates, new_rates=self.rates)
        # Last: "floor" says nothing else changed, so that the status may wait for others (ROUTINE).
        return why or ("floor" if now - self.last_at >= self.floor_s else "")

    def routine(self) -> bool:
        """Whether the status this interval sends is routine: the floor's, with nothing changed to report."""
        return self.reason == "floor"

    def floor_digest(self) -> bool:
        """Whether this interval's floor goes as the digest of the last status (a lease), not as the status."""
        return self.reason == "floor" and self.digest is not None and not self.digest_unconfirmed

    def lease(self, body: wire.Heartbeat, *, now: float) -> wire.Lease | None:
        """The lease to send instead of `body`, or None when the body (the status) must go."""
        self._measure_rates(body, now)
        if self.last is not None:
            # A port's first rate (a status carries none before two samples exist) is the baseline
            # later rates are compared with, not a change in itself.
            for key, rate in self.rates.items():
                self.last_rates.setdefault(key, rate)
        self.reason = self.why_status(body, now=now)
        if self.floor_digest():
            # Nothing moved past a threshold: the control plane's copy is still true, and it checks it holds it.
            return wire.Lease(node_id=body.node_id, at=body.at, acks=body.acks, status_digest=self.digest)
        if self.reason:
            return None
        return wire.Lease(node_id=body.node_id, at=body.at, acks=body.acks)

    def answered(
        self, sent: wire.Heartbeat | wire.Lease, answer: wire.HeartbeatResponse | wire.LeaseResponse, *, now: float
    ) -> None:
        """Record the control plane's answer to what was sent."""
        if isinstance(sent, wire.Heartbeat) and isinstance(answer, wire.HeartbeatResponse):
            self.supported = bool(answer.leases)
            self.last, self.last_at, self.last_rates = sent, now, dict(self.rates)
            if sent.gpu_fabrics is not None:
                self.last_fabrics = sent.gpu_fabrics
            self.digest, self.digest_unconfirmed = answer.status_digest, False
            self.wanted = self.again = False
        elif isinstance(answer, wire.LeaseResponse):
            self.wanted = answer.send_status
            self.again = answer.again or answer.send_status
            if isinstance(sent, wire.Lease) and sent.status_digest is not None:
                if answer.status_confirmed:
                    # The floor is done: the next is a floor's interval from now.
                    self.last_at = now
                elif not answer.send_status:
                    # Not checked (a lease endpoint that knows no digests): the floor goes whole next interval.
                    self.digest_unconfirmed = True
        self._again_run = self._again_run + 1 if self.again else 0

    def wait_s(self, interval: float) -> float:
        """How long to wait before the next heartbeat: none when the control plane said come back at once."""
        if self.again and self._again_run <= MAX_AGAIN:
            return 0.0
        return interval


def _rate(now_value: int | None, before: int | None, seconds: float) -> float:
    # A counter that went backwards was reset: no rate rather than a huge negative one.
    if now_value is None or before is None or seconds <= 0 or now_value < before:
        return 0.0
    return (now_value - before) * 8 / seconds
