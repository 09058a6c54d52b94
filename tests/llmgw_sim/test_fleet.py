"""The fleet simulator: virtual nodes built from the recorded profiles, their shards, their failures.

The first tests need no control plane: they read what a virtual node would
send and check it against the wire schema and the agent's own discovery. The
last one (slow) runs fifty virtual nodes against a real control plane process.
"""

from __future__ import annotations

import ipaddress
import json
import subprocess
import sys
import time
from collections.abc import Callable

import pytest
from django.utils import timezone

import llmgw_wire as wire
from llmgw_agent import discovery
from llmgw_agent.status import MAX_AGAIN
from llmgw_sim.fleet import (
    _ROUTINE_HEAD,
    EDGES,
    HEARTBEAT_PATH,
    TERMINAL_REPORTS,
    XID_OFF_BUS,
    Connection,
    Fleet,
    ProfileTemplate,
    histogram_percentile,
    routine_share,
)
from llmgw_sim.simulate import PROFILES_DIR, ZERO_UUID, shipped_profiles

S = wire.ShardState


def _fleet(nodes: int = 8, **kw) -> Fleet:
    return Fleet(control_plane="http://127.0.0.1:9", join_token="join", nodes=nodes, seed=7, **kw)


def _reg(node) -> wire.Register:
    return wire.Register.model_validate_json(node.registration())


def _hb(node, now: float) -> wire.Heartbeat:
    body, _ = node.heartbeat(now)
    return wire.Heartbeat.model_validate_json(body)


def _one_connection(server, *, nodes: int = 1, timeout_s: float = 5) -> Fleet:
    """A fleet of `nodes` against `server` (an asyncio server on loopback), over one connection to it."""
    fleet = Fleet(control_plane=f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", join_token="j", nodes=nodes)
    fleet.use_connections([Connection(fleet.control_plane, timeout_s=timeout_s)])
    return fleet


def test_fleet_imports_no_django():
    code = "import sys, llmgw_sim.fleet\nprint(','.join(sorted(m for m in sys.modules if m.startswith('django'))))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env={"PATH": ""})
    assert out.stdout.strip() == ""


def test_profile_template_is_what_discovery_reads():
    for name in shipped_profiles():
        t = ProfileTemplate.read(name)
        found = discovery.discover(root=PROFILES_DIR / name, model_dirs=[])
        assert [g["uuid"] for g in t.registration.get("gpus", [])] == [g.uuid for g in found.gpus]
        assert t.registration.get("memory_total_mb") == found.memory_total_mb
        assert t.registration["engine_versions"] == found.engine_versions
        sampled = discovery.sample(root=PROFILES_DIR / name)
        assert [p["hca"] for p in t.heartbeat.get("ib_ports") or []] == [p.hca for p in sampled.ib_ports]


def test_virtual_nodes_have_their_own_identities():
    fleet = _fleet(nodes=12)
    regs = [_reg(n) for n in fleet.nodes]
    assert [r.node_id for r in regs] == [n.node_id for n in fleet.nodes]
    assert len({r.node_id for r in regs}) == 12
    assert len({r.mgmt_addr for r in regs}) == 12
    # On loopback only: a replica's endpoint is built from it, and a gateway reaching for one must find
    # this machine or nothing, never a network the simulation does not own.
    assert regs[5].mgmt_addr == "127.100.0.5"
    far = Fleet(control_plane="http://127.0.0.1:9", join_token="join", nodes=2, first=65_535)
    assert [_reg(n).mgmt_addr for n in far.nodes] == ["127.100.255.255", "127.101.0.0"]
    assert all(ipaddress.ip_address(r.mgmt_addr).is_loopback for r in regs)
    assert regs[5].node_id == "fleet-gb200-nvl-00005"
    assert regs[5].hostname == "fleet-gb200-nvl-00005.sim"
    assert regs[5].labels == {"simulated": "true", "profile": "gb200-nvl"}
    uuids = [g.uuid for r in regs for g in r.gpus]
    assert len(uuids) == len(set(uuids)) == sum(len(r.gpus) for r in regs)
    # Each profile's cards and fabrics, as its recorded tools say.
    by_profile = {n.profile.name: r for n, r in zip(fleet.nodes, regs, strict=True)}
    assert {k: len(r.gpus) for k, r in by_profile.items()} == {"cpu-only": 0, "gb200-nvl": 4, "hgx-h100": 8, "roce": 1}
    assert [f.name for f in by_profile["hgx-h100"].fabrics] == ["ib-a", "ib-b"]
    # Adapters' GUIDs are the node's own, the vendor part kept.
    guids = {_hb(n, 1.0).ib_ports[0].port_guid for n in fleet.nodes if n.profile.name == "hgx-h100"}
    assert len(guids) == 3
    assert all(g.startswith("0xec0d9a03") for g in guids)


def test_trays_fill_nvlink_domains_of_domain_size():
    fleet = _fleet(nodes=4 * 5, domain_size=2, profiles=["gb200-nvl"] * 4)
    domains = [{g.fabric.cluster_uuid for g in _reg(n).gpus} for n in fleet.nodes]
    assert all(len(d) == 1 for d in domains)
    flat = [d.pop() for d in domains]
    assert ZERO_UUID not in flat
    # Two trays a domain, in order, whether one process makes them all or two share the numbering.
    assert len(set(flat)) == 10
    assert flat[0] == flat[1] != flat[2] == flat[3]
    second = _fleet(nodes=10, first=10, domain_size=2, profiles=["gb200-nvl"] * 4)
    assert [_reg(n).gpus[0].fabric.cluster_uuid for n in second.nodes] == flat[10:]
    # The once-a-minute fabric report names the same domain.
    hb = _hb(fleet.nodes[0], 1e9)
    assert {f.fabric.cluster_uuid for f in hb.gpu_fabrics} == {flat[0]}


def test_heartbeats_are_valid_and_counters_grow():
    fleet = _fleet(nodes=4)
    for n in fleet.nodes:
        first, second = _hb(n, 100.0), _hb(n, 105.0)
        assert first.node_id == n.node_id and first.at == 100.0 and second.at == 105.0
        assert len(first.gpus or []) == len(n.profile.heartbeat.get("gpus") or [])
        for a, b in zip(first.ib_ports or [], second.ib_ports or [], strict=True):
            assert b.counters["port_xmit_data"] > a.counters["port_xmit_data"]
            assert b.counters["port_rcv_data"] > a.counters["port_rcv_data"]


def test_shards_start_load_become_ready_and_stop():
    fleet = _fleet(nodes=3, load_s=1.0, ready_s=3.0)
    node = fleet.nodes[2]
    start = {"kind": "start_shard", "id": "c1", "replica_id": "r1", "shard_id": "s1", "http_port": 18001,
             "gpu_indices": [0, 1], "profile": {"engine": "echo"}}  # fmt: skip
    node.apply(start, 100.0)
    assert [(s.shard_id, s.state, s.http_port) for s in _hb(node, 100.5).shards] == [("s1", S.STARTING, 18001)]
    assert [s.state for s in _hb(node, 101.0).shards] == [S.LOADING]
    assert [s.state for s in _hb(node, 103.0).shards] == [S.READY]
    # Offered for adoption when the node registers again.
    assert [(r.shard_id, r.state, r.gpu_indices) for r in _reg(node).running_shards] == [("s1", S.READY, [0, 1])]
    # Applied once: the same id again is acknowledged, not applied.
    node.apply({**start, "http_port": 18002}, 104.0)
    assert node.shards["s1"].http_port == 18001
    assert list(node.acks) == ["c1"]
    node.apply({"kind": "stop_shard", "id": "c2", "shard_id": "s1"}, 105.0)
    assert _reg(node).running_shards == []
    reports = [[s.state for s in _hb(node, 106.0 + i).shards] for i in range(TERMINAL_REPORTS + 1)]
    assert reports == [[S.STOPPED]] * TERMINAL_REPORTS + [[]]
    assert fleet.stats.commands == {"start_shard": 1, "stop_shard": 1}


def test_a_shard_becoming_ready_is_reported_at_the_next_one_second_poll_not_an_interval_later():
    # The agent's wait polls its supervisor every second and heartbeats when a shard is ready
    # (llmgw_agent/loop.py _wait): a virtual node waits no longer than that.
    fleet = _fleet(nodes=1, interval=5.0, load_s=0.5, ready_s=1.5)
    node = fleet.nodes[0]
    now = [100.0]
    fleet.clock = lambda: now[0]
    assert fleet._next_beat(node, 5.2) == 5.2  # no shard: the interval (with its jitter)
    node.apply({"kind": "start_shard", "id": "c1", "replica_id": "r1", "shard_id": "s1", "http_port": 18001,
                "gpu_indices": [0], "profile": {"engine": "echo"}}, 100.0)  # fmt: skip
    # Loading at 100.5 is a start's progress, reported with the next heartbeat; ready at 101.5 is not.
    assert node.next_change(100.0) == 101.5
    assert fleet._next_beat(node, 5.2) == 2.0  # ready, seen at the second poll
    now[0] = 101.0
    assert node.next_change(101.0) == 101.5
    assert fleet._next_beat(node, 5.2) == 1.0
    now[0] = 102.0
    assert node.next_change(102.0) is None
    assert fleet._next_beat(node, 4.9) == 4.9  # ready and steady: the interval again
    # A change further off than the interval waits for the heartbeat that comes first.
    slow = _fleet(nodes=1, interval=5.0, load_s=9.0, ready_s=30.0)
    slow.clock = lambda: 200.0
    slow.nodes[0].apply({"kind": "start_shard", "id": "c1", "shard_id": "s1", "gpu_indices": [0]}, 200.0)
    assert slow._next_beat(slow.nodes[0], 5.0) == 5.0


def test_a_starts_progress_leaves_the_status_as_it_was_and_its_ready_does_not():
    # As an agent's StatusGate (llmgw_agent/status.py shards_change): a lease until the shard is ready.
    fleet = _fleet(nodes=1, load_s=0.5, ready_s=1.5)
    node = fleet.nodes[0]
    before = node.status_key(100.0)
    node.apply({"kind": "start_shard", "id": "c1", "shard_id": "s1", "gpu_indices": [0]}, 100.0)
    assert node.status_key(100.2) == before  # starting
    assert node.status_key(101.0) == before  # loading
    assert node.status_key(101.5) != before  # ready
    node.leases, node.status = True, (100.0, before)
    assert node.lease(101.0) is not None and node.lease(101.5) is None


def test_an_answer_that_says_come_back_is_followed_at_once_up_to_the_agents_limit():
    fleet = _fleet(nodes=1)
    node = fleet.nodes[0]
    fleet.clock = lambda: 100.0
    node.again_run = 1
    assert fleet._next_beat(node, 5.0) == 0.0
    node.again_run = MAX_AGAIN
    assert fleet._next_beat(node, 5.0) == 0.0
    # As an agent's StatusGate: a control plane that keeps saying `again` does not make a busy loop.
    node.again_run = MAX_AGAIN + 1
    assert fleet._next_beat(node, 5.0) == 5.0


def test_a_lease_answer_saying_again_or_send_status_counts_towards_coming_back_at_once():
    import asyncio

    answers = [b'{"again": true}', b'{"send_status": true}', b"{}", b'{"again": true}']

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await _request(reader) is not None:
            body = answers.pop(0)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            await writer.drain()

    async def main() -> list[int]:
        cp = await asyncio.start_server(serve, "127.0.0.1", 0)
        fleet = _one_connection(cp)
        node = fleet.nodes[0]
        node.registered, node.credential = True, "tok"
        runs = []
        for _ in range(4):
            # Leases allowed and the last status still current: what goes out is a lease.
            node.leases, node.status = True, (fleet.clock(), node.status_key(fleet.clock()))
            assert await fleet._heartbeat(node)
            runs.append(node.again_run)
        fleet._connections.get_nowait().close()
        cp.close()
        await cp.wait_closed()
        return runs

    assert asyncio.run(main()) == [1, 2, 0, 1]


def test_heartbeat_carries_acks_until_answered():
    fleet = _fleet(nodes=1)
    node = fleet.nodes[0]
    node.apply({"kind": "install_engine", "id": "c9", "engine": "vllm"}, 1.0)
    body, acks = node.heartbeat(2.0)
    assert acks == ["c9"]
    assert json.loads(body)["acks"] == ["c9"]


def test_a_port_goes_down_and_comes_back():
    fleet = _fleet(nodes=3)
    node = fleet.nodes[2]
    before = _hb(node, 1.0)
    fleet.port_down(node.node_id, "mlx5_1")
    down = _hb(node, 2.0)
    ports = {p.hca: p for p in down.ib_ports}
    assert (ports["mlx5_1"].state, ports["mlx5_1"].phys_state, ports["mlx5_1"].sm_guid) == ("1: DOWN", "2: Polling", "")
    assert ports["mlx5_1"].counters["link_downed"] == before.ib_ports[1].counters["link_downed"] + 1
    assert {p.hca for p in down.ib_ports if p.state == "4: ACTIVE"} == {f"mlx5_{i}" for i in range(8)} - {"mlx5_1"}
    fleet.port_down(node.node_id, "mlx5_1", down=False)
    assert {p.state for p in _hb(node, 3.0).ib_ports} == {"4: ACTIVE"}


def test_a_card_falls_off_the_bus():
    fleet = _fleet(nodes=3)
    node = fleet.nodes[2]
    node.registered = True
    fleet.card_off(node.node_id, 3)
    assert node.registered is False  # registers again, as a restarted agent would
    gpus = {g.index: g for g in _hb(node, 1.0).gpus}
    assert gpus[3].problems == [f"XID {XID_OFF_BUS}: GPU has fallen off the bus: reboot the node"]
    assert (gpus[3].wear.last_xid, gpus[3].wear.xid_errors, gpus[3].util_percent) == (XID_OFF_BUS, 1, -1)
    assert all(not gpus[i].problems for i in gpus if i != 3)
    reg = {g.index: g for g in _reg(node).gpus}
    assert reg[3].problems == gpus[3].problems and not reg[2].problems


def test_control_document_sets_every_fault():
    fleet = _fleet(nodes=4)
    a, b, c = (n.node_id for n in fleet.nodes[1:4])
    fleet.apply_control({"silence": [a], "lose_answers": [b], "ports_down": {c: ["mlx5_0"]}, "cards_off": {c: [1]}})
    assert [(n.faults.silent, n.faults.lose_answers) for n in fleet.nodes] == [
        (False, False), (True, False), (False, True), (False, False),
    ]  # fmt: skip
    assert (fleet.by_id[c].faults.ports_down, fleet.by_id[c].faults.cards_off) == ({"mlx5_0"}, {1})
    fleet.apply_control({})
    assert not any(n.faults.silent or n.faults.lose_answers or n.faults.any_report() for n in fleet.nodes)


def test_histogram_percentile():
    counts = [0] * len(EDGES)
    counts[10] = 98
    counts[40] = 1
    counts[80] = 1
    assert histogram_percentile(counts, 50) == EDGES[10]
    assert histogram_percentile(counts, 99) == EDGES[40]
    assert histogram_percentile(counts, 100) == EDGES[80]
    assert histogram_percentile([0] * len(EDGES), 99) == 0.0


def test_connection_reads_length_and_chunked_answers_and_reconnects():
    import asyncio

    from llmgw_sim.fleet import Connection, TransportError

    seen: list[bytes] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError:
                break
            length = int(next(h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")).split(b":")[1])
            seen.append(head.split(b"\r\n")[2] + b" " + await reader.readexactly(length))
            if len(seen) == 1:
                writer.write(b'HTTP/1.1 200 OK\r\nContent-Length: 12\r\n\r\n{"ok": true}')
            elif len(seen) == 2:
                writer.write(
                    b'HTTP/1.1 403 Forbidden\r\nTransfer-Encoding: chunked\r\n\r\n3\r\n{"a\r\n5\r\n": 1}\r\n0\r\n\r\n'
                )
            else:
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\n[]")
                await writer.drain()
                writer.close()
                break
            await writer.drain()

    async def main() -> list:
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        conn = Connection(f"http://127.0.0.1:{port}", timeout_s=5)
        out = []
        for body in (b"1", b"22", b"333", b"4444"):
            a = await conn.post("/api/v1/agent/heartbeat", body, "tok")
            out.append((a.status_code, a.json()))
        server.close()
        await server.wait_closed()
        dead = Connection(f"http://127.0.0.1:{port}", timeout_s=5)
        with pytest.raises(TransportError):
            await dead.post("/x", b"", "tok")
        return out

    assert asyncio.run(main()) == [(200, {"ok": True}), (403, {"a": 1}), (200, []), (200, [])]
    # Three requests on the first connection; the fourth opened a new one after "Connection: close".
    assert seen == [b"Authorization: Bearer tok 1", b"Authorization: Bearer tok 22",
                    b"Authorization: Bearer tok 333", b"Authorization: Bearer tok 4444"]  # fmt: skip


def test_leases_go_to_the_named_gateway_and_each_node_s_to_the_control_plane_when_its_own_failed():
    import asyncio

    seen: list[tuple[str, bytes, bytes]] = []
    gateway_status = [b"200 OK"]

    def server(name: str):
        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while (got := await _request(reader)) is not None:
                lines = got[0].split(b"\r\n")
                token = next(h for h in lines if h.startswith(b"Authorization:")).split(b" ")[-1]
                seen.append((name, lines[0].split(b" ")[1], token))
                status = gateway_status[0] if name == "gw" else b"200 OK"
                writer.write(b"HTTP/1.1 " + status + b"\r\nContent-Length: 2\r\n\r\n{}")
                await writer.drain()

        return serve

    async def main() -> None:
        cp = await asyncio.start_server(server("cp"), "127.0.0.1", 0)
        gw = await asyncio.start_server(server("gw"), "127.0.0.1", 0)
        fleet = _one_connection(cp, nodes=2)
        a, b = fleet.nodes
        a.credential, b.credential = "a", "b"
        now = [1000.0]
        fleet.clock = lambda: now[0]
        assert (await fleet._post_lease(a, b"{}")).status_code == 200
        fleet.lease_url = f"http://127.0.0.1:{gw.sockets[0].getsockname()[1]}/api/v1/agent/lease"
        assert (await fleet._post_lease(a, b"{}")).status_code == 200
        # The gateway fails a's lease: a's leases go to the control plane for a minute, b's still to the gateway.
        gateway_status[0] = b"503 Service Unavailable"
        assert (await fleet._post_lease(a, b"{}")).status_code == 200
        gateway_status[0] = b"200 OK"
        assert (await fleet._post_lease(b, b"{}")).status_code == 200
        now[0] += 30
        assert (await fleet._post_lease(a, b"{}")).status_code == 200
        assert (await fleet._post_lease(b, b"{}")).status_code == 200
        now[0] += 31
        assert (await fleet._post_lease(a, b"{}")).status_code == 200
        assert (a.lease_fallback_until, b.lease_fallback_until) == (1060.0, 0.0)
        for q in (fleet._connections, fleet._lease_connections):
            q.get_nowait().close()
        for srv in (cp, gw):
            srv.close()
            await srv.wait_closed()

        counted.update(fleet.stats.as_dict())

    counted: dict = {}
    asyncio.run(main())
    lease = wire.LEASE_PATH.encode()
    assert seen == [
        ("cp", lease, b"a"),
        ("gw", lease, b"a"),
        ("gw", lease, b"a"),
        ("cp", lease, b"a"),
        ("gw", lease, b"b"),
        ("cp", lease, b"a"),
        ("gw", lease, b"b"),
        ("gw", lease, b"a"),
    ]
    # One failure at the gateway; the lease it failed and a's one 30 s later went to the web server;
    # the four the gateway answered were timed apart.
    assert (counted["lease_fallbacks"], counted["leases_to_control_plane"]) == (1, 2)
    assert sum(counted["lease_latency"]) == 4


def test_a_status_waiting_for_its_answer_is_accompanied_by_leases_to_the_gateway(monkeypatch):
    # As an agent's (llmgw_agent/keepalive.py): the web tier holds the status, the gateway renews the node.
    import asyncio

    from llmgw_sim import fleet as fleet_mod

    seen: list[tuple[str, bytes, bytes]] = []
    node_ids: list[str] = []

    async def main() -> None:
        leased = asyncio.Event()

        def server(name: str):
            async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
                while (got := await _request(reader)) is not None:
                    head, body = got
                    seen.append((name, head.split(b" ")[1], body))
                    if name == "gw":
                        leased.set()
                    elif hold[0]:
                        await asyncio.wait_for(leased.wait(), 10)
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
                    await writer.drain()

            return serve

        hold = [True]
        cp = await asyncio.start_server(server("cp"), "127.0.0.1", 0)
        gw = await asyncio.start_server(server("gw"), "127.0.0.1", 0)
        fleet = _one_connection(cp)
        (node,) = fleet.nodes
        node_ids.append(node.node_id)
        node.credential, node.interval = "tok", 60.0
        # A control plane that names no gateway: the status goes alone, however long it waits.
        monkeypatch.setattr(fleet_mod, "KEEPALIVE_AFTER_S", 0.0)
        hold[0] = False
        assert (await fleet._status(node, b"{}")).status_code == 200
        await asyncio.sleep(0)  # a lease begun now would have been sent by here
        # One that names its gateway (in the registration's answer): the held status, the node's first
        # (no status answered yet to say leases are taken), is answered once a lease renewed the node.
        fleet.lease_url = f"http://127.0.0.1:{gw.sockets[0].getsockname()[1]}/api/v1/agent/lease"
        assert not node.leases
        hold[0] = True
        monkeypatch.setattr(fleet_mod, "KEEPALIVE_AFTER_S", 0.05)
        assert (await fleet._status(node, b"{}")).status_code == 200
        assert fleet.stats.keepalives == 1
        for q in (fleet._connections, fleet._lease_connections):
            q.get_nowait().close()
        for task in list(fleet._keepalives):
            task.cancel()
        for srv in (cp, gw):
            srv.close()
            await srv.wait_closed()

    asyncio.run(main())
    heartbeat, lease = b"/api/v1/agent/heartbeat", wire.LEASE_PATH.encode()
    assert [(name, path) for name, path, _ in seen] == [("cp", heartbeat), ("cp", heartbeat), ("gw", lease)]
    lease_body = json.loads(seen[2][2])
    assert (lease_body["node_id"], lease_body["acks"]) == (node_ids[0], [])


def test_a_status_sent_only_for_the_floor_says_it_is_routine_as_an_agents_does():
    import asyncio

    got: list[tuple[bytes, bytes]] = []

    async def main() -> None:
        cp, fleet, node, now = await _one_node(got)
        assert await fleet._heartbeat(node)  # its first status: answered, the node has joined
        assert (fleet.stats.first_statuses, node.leases) == (1, True)
        now[0] += 60  # the floor, nothing changed
        assert await fleet._heartbeat(node)
        now[0] += 60  # the floor, and a port down
        fleet.port_down(node.node_id, "mlx5_0")
        assert await fleet._heartbeat(node)
        fleet._connections.get_nowait().close()
        cp.close()
        await cp.wait_closed()

    asyncio.run(main())
    assert [b"\r\nPriority: u=7\r\n" in head for head, _ in got] == [False, True, False]


def test_a_virtual_nodes_floor_goes_as_the_digest_of_its_last_status_as_an_agents_does():
    import asyncio

    got: list[tuple[bytes, bytes]] = []
    confirm = [True]

    def answer(body: bytes) -> dict:
        sent = json.loads(body)
        if "status_digest" in sent:
            ok = confirm[0] and sent["status_digest"] == "d1"
            return {"send_status": not ok, "again": not ok, "status_confirmed": ok}
        return {"leases": True, "status_digest": "d1"}

    async def main() -> None:
        cp, fleet, node, now = await _one_node(got, answer)
        assert await fleet._heartbeat(node)  # its first status: its digest comes back
        assert node.digest == "d1"
        now[0] += 60  # the floor, nothing changed: a lease carrying the digest, confirmed
        assert await fleet._heartbeat(node)
        assert json.loads(got[-1][1])["status_digest"] == "d1" and node.status[0] == now[0]
        now[0] += 30  # within the minute after it: an ordinary lease
        assert await fleet._heartbeat(node)
        assert "status_digest" not in json.loads(got[-1][1])
        confirm[0] = False
        now[0] += 30  # the control plane lost the status: asked for, the whole status follows
        assert await fleet._heartbeat(node)
        assert node.status is None
        assert await fleet._heartbeat(node)
        assert "status_digest" not in json.loads(got[-1][1]) and "shards" in json.loads(got[-1][1])
        assert (fleet.stats.floor_digests, fleet.stats.floor_digests_unconfirmed) == (2, 1)
        assert fleet.stats.statuses_why == {"first": 1, "asked": 1}
        fleet._connections.get_nowait().close()
        cp.close()
        await cp.wait_closed()

    asyncio.run(main())
    assert len(got) == 5


def test_a_status_that_waited_for_a_connection_is_dated_when_it_was_sent():
    # Dated when it began to wait, it read at the control plane as the node's clock behind by the wait.
    import asyncio

    got: list[tuple[bytes, bytes]] = []

    async def main() -> None:
        cp, fleet, node, now = await _one_node(got)
        held = fleet._connections.get_nowait()  # another node's request on the one connection
        status = asyncio.create_task(fleet._heartbeat(node))
        await asyncio.sleep(0.05)
        assert got == []
        now[0] += 7.5
        fleet._connections.put_nowait(held)
        assert await status
        assert (json.loads(got[0][1])["at"], node.status[0]) == (1007.5, 1007.5)
        held.close()
        cp.close()
        await cp.wait_closed()

    asyncio.run(main())


def test_routine_statuses_leave_a_quarter_of_the_connections_to_the_others():
    # The web serves routine statuses last; holding every shared connection while they waited there, they
    # kept a status reporting a shard ready from reaching the web at all (an agent has a connection of its own).
    import asyncio

    seen: list[bytes] = []

    async def main() -> None:
        release = asyncio.Event()

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while (got := await _request(reader)) is not None:
                seen.append(got[1])
                if b"\r\nPriority: u=7\r\n" in got[0]:
                    await release.wait()
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
                await writer.drain()

        cp = await asyncio.start_server(serve, "127.0.0.1", 0)
        fleet = _one_connection(cp)
        fleet.use_connections([Connection(fleet.control_plane, timeout_s=30) for _ in range(4)])
        held = [
            asyncio.create_task(fleet._post(HEARTBEAT_PATH, b"floor", "tok", extra=_ROUTINE_HEAD, routine=True))
            for _ in range(4)
        ]
        while len(seen) < 3:
            await asyncio.sleep(0.01)
        answer = await asyncio.wait_for(fleet._post(HEARTBEAT_PATH, b"changed", "tok"), 10)
        assert (answer.status_code, seen) == (200, [b"floor"] * 3 + [b"changed"])
        release.set()
        assert [r.status_code for r in await asyncio.gather(*held)] == [200] * 4
        assert seen == [b"floor"] * 3 + [b"changed", b"floor"]
        for conn in fleet._all_connections:
            conn.close()
        cp.close()
        await cp.wait_closed()

    asyncio.run(main())
    assert [routine_share(n) for n in (1, 2, 4, 128)] == [1, 2, 3, 96]


def _recording(got: list[tuple[bytes, bytes]], answer: Callable[[bytes], dict] | None = None):
    """A control plane for asyncio.start_server: each request's head and body kept in `got`, leases said on.

    `answer`: the answer to a request's body, when not {"leases": true}.
    """

    async def serve(reader, writer) -> None:
        while (request := await _request(reader)) is not None:
            got.append(request)
            data = json.dumps(answer(request[1]) if answer else {"leases": True}).encode()
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(data), data))
            await writer.drain()

    return serve


async def _one_node(got: list[tuple[bytes, bytes]], answer: Callable[[bytes], dict] | None = None):
    """A recording control plane (_recording) and a fleet of one registered node over one connection to it.

    The fleet's clock is the test's to move: `now[0]`, 1000.0 at first.
    """
    import asyncio

    cp = await asyncio.start_server(_recording(got, answer), "127.0.0.1", 0)
    fleet = _one_connection(cp)
    now = [1000.0]
    fleet.clock = lambda: now[0]
    (node,) = fleet.nodes
    node.credential, node.registered = "tok", True
    return cp, fleet, node, now


async def _request(reader) -> tuple[bytes, bytes] | None:
    """One HTTP/1.1 request's head and body off a stream; None when the client has gone."""
    import asyncio

    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return None
    length = int(next(h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")).split(b":")[1])
    return head, await reader.readexactly(length)


def test_a_lease_unanswered_past_the_agents_lease_timeout_goes_to_the_control_plane_and_only_its_node_s_after_it():
    import asyncio

    from llmgw_agent.loop import LEASE_TIMEOUT_S

    seen: list[str] = []
    arrived = asyncio.Queue()

    async def control_plane(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while (got := await _request(reader)) is not None:
            seen.append("cp " + got[0].split(b"Bearer ")[1].split(b"\r\n")[0].decode())
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
            await writer.drain()

    async def stalled_gateway(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        seen.append("gw " + head.split(b"Bearer ")[1].split(b"\r\n")[0].decode())
        arrived.put_nowait(None)
        await asyncio.sleep(60)  # its event loop busy elsewhere: never answers

    async def main() -> None:
        cp = await asyncio.start_server(control_plane, "127.0.0.1", 0)
        gw = await asyncio.start_server(stalled_gateway, "127.0.0.1", 0)
        fleet = _one_connection(cp, nodes=2, timeout_s=30)
        a, b = fleet.nodes
        a.credential, b.credential = "a", "b"
        fleet.lease_url = f"http://127.0.0.1:{gw.sockets[0].getsockname()[1]}/api/v1/agent/lease"
        first = asyncio.ensure_future(fleet._post_lease(a, b"{}"))
        await arrived.get()
        # b's lease waits for the one connection to the gateway.
        second = asyncio.ensure_future(fleet._post_lease(b, b"{}"))
        await asyncio.sleep(0)
        (lease_conn,) = [c for c in fleet._all_connections if c.timeout_s == LEASE_TIMEOUT_S]
        lease_conn.expire(time.monotonic() + LEASE_TIMEOUT_S + 0.01)  # the watchdog's next look
        assert (await first).status_code == 200
        # a's failure is a's: b's lease, given the connection, goes to the gateway and fails on its own.
        await arrived.get()
        assert (a.lease_fallback_until > fleet.clock(), b.lease_fallback_until) == (True, 0.0)
        lease_conn.expire(time.monotonic() + LEASE_TIMEOUT_S + 0.01)
        assert (await second).status_code == 200
        assert b.lease_fallback_until > fleet.clock()
        # Four connections taken: a's two at once, b's to the gateway after waiting for it, then its other at once.
        waits = fleet.stats.pool_wait
        assert (sum(waits), waits[0]) == (4, 3)
        for c in fleet._all_connections:
            c.close()
        fleet._connections.get_nowait().close()
        for srv in (cp, gw):
            srv.close()

    asyncio.run(main())
    # The stalled gateway was asked by each node once; each lease was renewed by the control plane.
    assert seen == ["gw a", "cp a", "gw b", "cp b"]


def test_a_lease_is_spliced_yet_valid_on_the_wire():
    fleet = _fleet(nodes=2)
    node = fleet.nodes[1]
    node.leases, node.status = True, (100.0, node.status_key(100.0))
    body, acks, floor = node.lease(101.25)
    assert wire.Lease.model_validate_json(body) == wire.Lease(node_id=node.node_id, at=101.25, acks=[])
    assert (acks, floor) == ([], False)
    node.apply({"kind": "install_engine", "id": "c7", "engine": "vllm"}, 101.5)
    body, acks, floor = node.lease(102.0)
    assert wire.Lease.model_validate_json(body) == wire.Lease(node_id=node.node_id, at=102.0, acks=["c7"])
    assert (acks, floor) == (["c7"], False)
    # At the floor, with the digest the control plane gave its last status: the floor as that digest.
    node.digest = "0f" * 16
    body, acks, floor = node.lease(160.0)
    assert wire.Lease.model_validate_json(body) == wire.Lease(
        node_id=node.node_id, at=160.0, acks=["c7"], status_digest="0f" * 16
    )
    assert (acks, floor, fleet.stats.floor_digests) == (["c7"], True, 1)


def test_a_watched_connection_fails_a_request_past_its_timeout_and_reconnects():
    import asyncio

    from llmgw_sim.fleet import Connection, TransportError

    async def main() -> tuple:
        first = asyncio.Event()

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            if not first.is_set():
                first.set()  # the first request is never answered
                await asyncio.sleep(30)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
            await writer.drain()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        conn = Connection(f"http://127.0.0.1:{port}", timeout_s=0.2, watched=True)
        pending = asyncio.ensure_future(conn.post("/x", b"{}", "tok"))
        await first.wait()
        conn.expire(time.monotonic())  # not yet past 0.2 s: nothing happens
        assert not pending.done()
        await asyncio.sleep(0.3)
        conn.expire(time.monotonic())
        with pytest.raises(TransportError, match=r"no answer within 0\.2 s"):
            await pending
        answer = await conn.post("/x", b"{}", "tok")  # a new connection
        server.close()
        return answer.status_code, answer.json()

    assert asyncio.run(main()) == (200, {})


# --- against a real control plane -------------------------------------------------------------------------------


@pytest.fixture
def plane(transactional_db, tmp_path):
    from tests.test_control_plane_restart import ControlPlane, _kill_group

    cp = ControlPlane(tmp_path)
    cp.env["LLMGW_HEARTBEAT_INTERVAL"] = "1"
    try:
        yield cp
    finally:
        if cp.proc is not None:
            _kill_group(cp.proc, grace_s=5)


@pytest.mark.slow
def test_fifty_virtual_nodes_against_a_real_control_plane(plane, settings):
    from inventory import liveness, telemetry
    from inventory.models import GPU, Command, Node
    from placement.models import Deployment, EngineProfile, Replica
    from placement.tasks import reconcile_task
    from tests.test_control_plane_restart import JOIN, _wait

    plane.start()
    fleet = Fleet(control_plane=plane.url, join_token=JOIN, nodes=50, interval=1.0, load_s=0.2, ready_s=0.5, seed=3)
    ids = {n.node_id for n in fleet.nodes}
    by_profile = {p: sorted(n.node_id for n in fleet.nodes if n.profile.name == p) for p in fleet.profiles}

    def reconcile() -> None:
        reconcile_task(now=timezone.now())

    def summary() -> str:
        states = sorted(Node.objects.values_list("id", "state"))
        reps = list(Replica.objects.values_list("deployment__name", "state", "shards__node_id"))
        return f"stats {fleet.stats.as_dict() | {'latency': '', 'register_latency': ''}}; nodes {states}; {reps}"

    fleet.start_in_thread()
    try:
        # All registered, once each, none refused; the inventory is the recorded hardware's.
        # The row is written before the simulated agent counts the answer: wait for both.
        _wait(
            lambda: Node.objects.filter(state="ready").count() == 50 and fleet.stats.registered == 50,
            timeout=60,
            what=summary,
        )
        assert set(Node.objects.values_list("id", flat=True)) == ids
        assert fleet.stats.registered == 50 and not fleet.stats.register_refused
        assert GPU.objects.count() == 13 * 4 + 12 * 8 + 12 * 1
        assert len(set(GPU.objects.values_list("uuid", flat=True))) == 160
        domains = set(Node.objects.filter(id__in=by_profile["gb200-nvl"]).values_list("nvlink_domain", flat=True))
        assert len(domains) == 1 and "" not in domains

        # A deployment is placed, its shards start on the simulated nodes and its replicas are ready.
        eight = EngineProfile.objects.create(name="echo-8", engine="echo", gpus_per_node=8, startup_timeout_s=600)
        big = Deployment.objects.create(name="big", served_model="big", profile=eight, replicas=2)
        _wait(lambda: Replica.objects.filter(deployment=big, state="ready").count() == 2, timeout=60, what=summary,
              each=reconcile)  # fmt: skip
        hosts = set(Replica.objects.filter(deployment=big).values_list("shards__node_id", flat=True))
        assert len(hosts) == 2 and hosts <= set(by_profile["hgx-h100"])
        for r in Replica.objects.filter(deployment=big).prefetch_related("shards"):
            (shard,) = r.shards.all()
            sim = fleet.by_id[shard.node_id].shards[str(shard.id)]
            assert (sim.replica_id, sim.gpu_indices, fleet.shard_state(sim, time.time())) == (
                str(r.id), list(range(8)), S.READY
            )  # fmt: skip
        assert Command.objects.filter(kind="start_shard", acked_at__isnull=False).count() == 2

        # Lost answers: the node stays ready (its heartbeats arrive), its StartShard is sent again and again
        # but never reaches it, until the answers come through again.
        lossy = by_profile["roce"][0]
        fleet.lose_answers([lossy])
        one = EngineProfile.objects.create(name="echo-1", engine="echo", gpus_per_node=1, startup_timeout_s=600)
        small = Deployment.objects.create(
            name="small", served_model="small", profile=one, replicas=12, node_selector={"profile": "roce"}
        )
        _wait(lambda: Replica.objects.filter(deployment=small, state="ready").count() == 11, timeout=60,
              what=summary, each=reconcile)  # fmt: skip
        _wait(lambda: Command.objects.filter(node_id=lossy, kind="start_shard", deliveries__gte=3).exists(),
              timeout=30, what=summary)  # fmt: skip
        cmd = Command.objects.get(node_id=lossy, kind="start_shard")
        assert cmd.acked_at is None and fleet.by_id[lossy].shards == {}
        assert Node.objects.get(id=lossy).state == "ready"
        assert Replica.objects.get(deployment=small, shards__node_id=lossy).state != "ready"
        fleet.lose_answers([lossy], on=False)
        _wait(lambda: Replica.objects.filter(deployment=small, state="ready").count() == 12, timeout=60,
              what=summary, each=reconcile)  # fmt: skip
        cmd.refresh_from_db()
        assert cmd.acked_at is not None

        # A port goes down and a card falls off the bus on an idle node: the control plane sees both.
        idle = next(n for n in by_profile["hgx-h100"] if n not in hosts)
        fleet.port_down(idle, "mlx5_1")
        fleet.card_off(idle, 3)

        def port_state() -> str:
            entry = telemetry.get(idle) or {}
            return next((p["state"] for p in entry.get("ib_ports") or [] if p["hca"] == "mlx5_1"), "")

        _wait(lambda: port_state() == "1: DOWN", timeout=30, what=lambda: str(telemetry.get(idle)))
        off = f"XID {XID_OFF_BUS}: GPU has fallen off the bus: reboot the node"
        _wait(lambda: GPU.objects.get(node_id=idle, index=3).problems == [off], timeout=30, what=summary)
        assert next(g for g in (telemetry.get(idle) or {})["gpus"] if g["index"] == 3)["problems"] == [off]
        assert not GPU.objects.filter(node_id=idle).exclude(index=3).exclude(problems=[]).exists()

        # A silenced node goes unreachable, then lost, and its replica runs elsewhere; the rest stay ready.
        settings.LLMGW_UNREACHABLE_AFTER = 4
        settings.LLMGW_LOST_AFTER = 10
        victim = sorted(hosts)[0]
        fleet.silence([victim])
        silenced = timezone.now()
        _wait(lambda: Node.objects.get(id=victim).state == "unreachable", timeout=30, what=summary,
              each=lambda: liveness.sweep(now=timezone.now()))  # fmt: skip
        assert Node.objects.get(id=victim).last_seen < silenced
        _wait(lambda: Node.objects.get(id=victim).state == "lost", timeout=30, what=summary,
              each=lambda: liveness.sweep(now=timezone.now()))  # fmt: skip
        _wait(
            lambda: set(Replica.objects.filter(deployment=big, state="ready").values_list("shards__node_id", flat=True))
            .isdisjoint({victim}) and Replica.objects.filter(deployment=big, state="ready").count() == 2,
            timeout=60, what=summary, each=reconcile,
        )  # fmt: skip
        mark = timezone.now()
        _wait(lambda: Node.objects.filter(last_seen__gt=mark, state="ready").count() == 49, timeout=30, what=summary)
        assert Node.objects.exclude(state="ready").get().id == victim
    finally:
        fleet.join()


def test_a_steady_virtual_node_sends_leases_and_its_status_at_the_floor():
    # What the fleet bench's share of leases rests on: recorded sensors are steady, so between
    # statuses only a shard's state or a fault sends one, and the floor (60 s) one in twelve at 5 s.
    from llmgw_agent.status import STATUS_FLOOR_S

    fleet = Fleet(control_plane="http://127.0.0.1:9", join_token="j", nodes=4, seed=1)
    for node in fleet.nodes:
        assert node.lease(100.0) is None  # leases not offered yet
        node.leases, node.status = True, (100.0, node.status_key(100.0))
        sent = [node.lease(100.0 + 5 * k) is not None for k in range(1, 13)]
        assert sent == [True] * 11 + [False], node.profile.name
        assert STATUS_FLOOR_S == 5 * 12
        fleet.port_down(node.node_id, "mlx5_0")
        assert node.lease(105.0) is None
        fleet.port_down(node.node_id, "mlx5_0", down=False)
        assert node.lease(105.0) is not None
    # Each status that went instead of a lease, counted by why.
    assert dict(fleet.stats.statuses_why) == {"first": 4, "floor": 4, "changed": 4}
    node = fleet.nodes[0]
    node.status = None  # the control plane asked for it (send_status)
    assert (node.status_due(106.0), node.lease(106.0)) == ("asked", None)
    node.leases = False
    node.status = (106.0, node.status_key(106.0))
    assert node.status_due(107.0) == "no leases"
    assert fleet.stats.as_dict()["statuses_why"] == {"first": 4, "floor": 4, "changed": 4, "asked": 1}
    # Given a digest of its status, the floor goes as that digest instead: a lease, no status.
    node.leases, node.digest = True, "ab" * 16
    assert node.lease(106.0 + 60) is not None and fleet.stats.floor_digests == 1
    assert fleet.stats.as_dict()["statuses_why"] == {"first": 4, "floor": 4, "changed": 4, "asked": 1}
