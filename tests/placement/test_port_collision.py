"""Ports are facts: simulated nodes running the real agent, echo engines, and a real listener on a shard port.

The agents report what listens on their node, so the planner keeps off a port
another program holds; a port taken after the last report is found by the
agent's bind check right before the start, reported as such, and the replica
is placed again on another port without counting against its deployment.
"""

from __future__ import annotations

import socket

import pytest
from django.utils import timezone

from placement import backoff, kept, planner
from placement.models import Deployment, EngineProfile, PlacementEvent, Replica, Shard
from tests.placement.test_e2e import JOIN, Cluster
from tests.ports import free_port_range

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


def listen(port: int) -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", port))
    s.listen()
    return s


def ready_ports() -> list[int]:
    return sorted(Shard.objects.filter(replica__state="ready").values_list("http_port", flat=True))


def test_a_port_in_use_is_never_handed_out_and_a_collision_is_placed_again_unpenalised(live_server, tmp_path, settings):
    pytest.importorskip("llmgw_sim.simulate")
    settings.LLMGW_JOIN_TOKEN = JOIN
    base = settings.LLMGW_SHARD_PORT_BASE = free_port_range()
    cluster = Cluster(live_server.url, tmp_path / "fleet", 2)
    listeners = []
    try:
        # Another program listens on the base port before the agents report: never handed out.
        listeners.append(listen(base))
        for a in cluster.agents.values():
            a.step()
        prof = EngineProfile.objects.create(
            name="echo-1", engine="echo", gpus_per_node=1, args=["--load-seconds", "0.1"], startup_timeout_s=60
        )
        dep = Deployment.objects.create(name="echo", served_model="echo-model", profile=prof, replicas=1)
        cluster.until(lambda: ready_ports())
        assert ready_ports() == [base + 1]

        # The port the planner would hand out next is taken after the agents' last report.
        snap = kept.scratch(now=timezone.now())
        plan = planner.plan(planner.ReplicaRequest.from_profile(prof), snap)
        taken = plan.shards[0].http_port
        assert taken == base + 2
        listeners.append(listen(taken))
        dep.replicas = 2
        dep.save()
        cluster.until(lambda: len(ready_ports()) == 2)

        # The agent refused the port before starting anything, and said why.
        clash = Shard.objects.get(http_port=taken)
        assert (clash.state, clash.port_in_use, clash.exit_code) == ("failed", taken, None)
        assert clash.reason == f"port {taken} is already in use on this node (another program listens on it)"
        failed = clash.replica
        why = (
            f"shard 0 on {clash.node_id}: port {taken} was already in use on the node;"
            " placed again on another port (not counted as a failed start)"
        )
        assert (failed.state, failed.reason) == ("failed", why)
        assert PlacementEvent.objects.filter(replica=failed, kind="state", to_state="failed", reason=why).exists()

        # Ready on another port, at once: no backoff, no node avoided.
        (again,) = Replica.objects.filter(state="ready").exclude(shards__http_port=base + 1)
        assert again.not_before is None
        assert [s.http_port for s in again.shards.all()] == [base + 3]
        assert backoff.start_failures({dep.id}, now=timezone.now()) == {}
        assert backoff.avoidances(dep, now=timezone.now()) == []
        assert ready_ports() == [base + 1, base + 3]
    finally:
        for s in listeners:
            s.close()
        cluster.close()
