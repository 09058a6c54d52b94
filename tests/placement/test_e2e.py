"""End to end: deployments of the echo engine on simulated agents talking HTTP to the real control plane.

Four simulated H100 nodes (recorded hardware, fixture mode), each a real
node agent (registration, heartbeats, commands) whose echo shards are real
processes. The test drives time itself: a reconcile pass, then one
heartbeat per agent, until what it waits for is true.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import os
import signal
import time

import pytest
from django.core.cache import cache
from django.utils import timezone

from inventory import liveness
from inventory.models import Command, NodeEvent
from inventory.nodes import change_state
from placement.models import Deployment, EngineProfile, Replica, Shard
from placement.reconciler import reconcile
from tests.ports import free_port_range

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

JOIN = "e2e-join-token-for-placement"


class Cluster:
    """Simulated agents, stepped by the test."""

    def __init__(self, url: str, workdir, n: int) -> None:
        from llmgw_agent import config as config_mod
        from llmgw_sim.simulate import prepare_node

        workdir.mkdir(parents=True, exist_ok=True)
        token = workdir / "join-token"
        token.write_text(JOIN)
        self.url, self.agents, self.nodes = url, {}, []
        for i in range(n):
            node = prepare_node(
                index=i, profile="hgx-h100", workdir=workdir, control_plane=url, token_file=token, heartbeat_interval=1
            )
            self.nodes.append(node)
            cfg = dataclasses.replace(config_mod.load(str(node.config)), root=str(node.root))
            self.agents[node.node_id] = self._agent(cfg)
        self.configs = {nid: a.config for nid, a in self.agents.items()}

    @staticmethod
    def _agent(cfg):
        from llmgw_agent.loop import Agent, DiscoveryProbe

        return Agent(cfg, probe=DiscoveryProbe(root=cfg.root, model_dirs=list(cfg.model_dirs)))

    def step(self) -> None:
        reconcile(now=timezone.now())
        for a in self.agents.values():
            a.step()

    def until(self, cond, *, timeout: float = 30.0, each=None):
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            self.step()
            if each is not None:
                each()
            got = cond()
            if got:
                return got
            time.sleep(0.05)
        pytest.fail(f"not reached in {timeout}s: {summary()}")

    def kill(self, node_id: str) -> None:
        """The machine dies: its agent and its shards with it."""
        agent = self.agents.pop(node_id)
        pids = agent.supervisor.pids()
        agent.close()
        for pid in pids.values():
            with contextlib.suppress(OSError):
                os.killpg(pid, signal.SIGKILL)

    def restart_agents(self) -> None:
        """New agent objects on the same state directories: they adopt their running shards."""
        for nid, a in list(self.agents.items()):
            a.close()
            self.agents[nid] = self._agent(self.configs[nid])

    def pids(self) -> dict[str, int]:
        return {sid: pid for a in self.agents.values() for sid, pid in a.supervisor.pids().items()}

    def close(self) -> None:
        for nid in list(self.agents):
            self.kill(nid)


def summary() -> str:
    return "; ".join(
        f"{r.state}:{r.reason}:{[(s.node_id, s.state) for s in r.shards.all()]}"
        for r in Replica.objects.prefetch_related("shards")
    )


def ready_count() -> int:
    return Replica.objects.filter(state="ready").count()


@pytest.fixture
def cluster(live_server, tmp_path, settings):
    pytest.importorskip("llmgw_sim.simulate")
    settings.LLMGW_JOIN_TOKEN = JOIN
    # Four simulated nodes share this host's loopback, as `make demo`'s do: the
    # control plane keeps their shard ports apart by itself (no LLMGW_SHARD_PORTS_UNIQUE).
    settings.LLMGW_SHARD_PORT_BASE = free_port_range()
    c = Cluster(live_server.url, tmp_path / "fleet", 4)
    try:
        yield c
    finally:
        c.close()


def test_echo_deployment_survives_loss_drain_and_restart(cluster):
    for a in cluster.agents.values():
        a.step()
    prof = EngineProfile.objects.create(
        name="echo-8", engine="echo", gpus_per_node=8, args=["--load-seconds", "0.2"], startup_timeout_s=60
    )
    dep = Deployment.objects.create(name="echo", served_model="echo-model", profile=prof, replicas=2)

    # A deployment becomes ready replicas, each answering at its endpoint.
    cluster.until(lambda: ready_count() == 2)
    import httpx

    for rep in Replica.objects.filter(state="ready"):
        assert httpx.get(f"{rep.endpoint}/v1/models", timeout=5).status_code == 200
    first_nodes = set(Shard.objects.filter(replica__state="ready").values_list("node_id", flat=True))
    assert len(first_nodes) == 2

    # A node is lost: its replica comes back elsewhere.
    dead = sorted(first_nodes)[0]
    cluster.kill(dead)
    now = timezone.now()
    # Silent since before now: what the liveness sweep decides after its timeouts.
    assert liveness.mark_unreachable(dead, now=now, cutoff=now + dt.timedelta(seconds=1))
    assert liveness.mark_lost(dead, now=now, cutoff=now + dt.timedelta(seconds=1)) is not None
    cluster.until(lambda: ready_count() == 2)
    lost_replica = Replica.objects.get(shards__node_id=dead)
    assert (lost_replica.state, lost_replica.reason) == ("failed", f"node {dead} lost")
    now_nodes = set(Shard.objects.filter(replica__state="ready").values_list("node_id", flat=True))
    assert dead not in now_nodes and len(now_nodes) == 2

    # A node is drained: the ready count never drops below two.
    drained = sorted(now_nodes)[0]
    change_state(drained, "draining", now=timezone.now(), reason="maintenance")
    low = []

    def watch():
        n = ready_count()
        if n < 2:
            low.append(n)

    cluster.until(lambda: NodeEvent.objects.filter(node_id=drained, kind="drained").exists(), each=watch)
    assert low == []
    assert ready_count() == 2
    assert not Shard.objects.filter(node_id=drained, replica__state="ready").exists()

    # The control plane restarts (its cache is gone, agents register again): no shard restarts.
    pids = cluster.pids()
    live = set(pids)
    starts = Command.objects.filter(kind="start_shard").count()
    cache.clear()
    cluster.restart_agents()
    for _ in range(3):
        cluster.step()
    assert cluster.pids() == pids
    assert Command.objects.filter(kind="start_shard").count() == starts
    assert ready_count() == 2
    ready_shards = {str(s) for s in Shard.objects.filter(replica__state="ready").values_list("id", flat=True)}
    assert ready_shards <= live
    assert dep.replica_set.filter(state__in=["pending", "starting"]).count() == 0
