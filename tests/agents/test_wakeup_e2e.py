"""End to end: a deployment's replica is ready about two seconds after the POST, not a heartbeat interval later.

Two simulated H100 nodes (recorded hardware, fixture mode), each a real node
agent running its own loop with a 30 s heartbeat interval, holding the
wakeup long-poll open on a real gateway process (granian, as `make run`
starts it) against the live control plane. Without the wakeup the replica
could not be ready before the next heartbeat, 30 s away; with it the
StartShard is fetched the moment its transaction commits, and the shard's
change to ready is reported the moment the agent sees it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import threading
import time

import pytest
from django.db import close_old_connections
from django.utils import timezone

from placement.models import Deployment, EngineProfile, Replica
from placement.reconciler import reconcile
from tests.gateway.conftest import Gateway
from tests.ports import free_port_range

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

JOIN = "wakeup-e2e-join-token"
INTERVAL_S = 30.0
# Stands in for the reconcile the heartbeat queues on Celery (placement/agent_sync.py queue_reconcile).
RECONCILE_EVERY_S = 0.1


@pytest.fixture
def fleet(live_server, tmp_path, settings):
    from llmgw_agent import config as config_mod
    from llmgw_agent.loop import Agent, DiscoveryProbe
    from llmgw_sim.simulate import prepare_node

    settings.LLMGW_JOIN_TOKEN = JOIN
    settings.LLMGW_SHARD_PORT_BASE = free_port_range()
    gateway = Gateway(tmp_path, "gateway")
    gateway.start()
    token = tmp_path / "join-token"
    token.write_text(JOIN)
    agents, threads = [], []
    try:
        for i in range(2):
            node = prepare_node(
                index=i,
                profile="hgx-h100",
                workdir=tmp_path / "fleet",
                control_plane=live_server.url,
                token_file=token,
                heartbeat_interval=INTERVAL_S,
            )
            cfg = config_mod.load(str(node.config))
            cfg = dataclasses.replace(cfg, root=str(node.root), wakeup_url=gateway.url)
            agent = Agent(cfg, probe=DiscoveryProbe(root=cfg.root, model_dirs=list(cfg.model_dirs)))
            agent.step()  # registered, and heard from
            agents.append(agent)
        for agent in agents:
            t = threading.Thread(target=agent.run, daemon=True)
            t.start()
            threads.append(t)
        yield agents, gateway
    finally:
        for agent in agents:
            pids = agent.supervisor.pids()
            agent.close()
            for pid in pids.values():
                with contextlib.suppress(OSError):
                    os.killpg(pid, signal.SIGKILL)
        for t in threads:
            t.join(timeout=5)
        gateway.stop()


def test_replica_ready_about_two_seconds_after_the_post(fleet):
    agents, gateway = fleet
    # Each agent's first long-poll is open (its heartbeat of the first step went out long ago).
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not all(a.listener and a.listener._thread for a in agents):
        time.sleep(0.05)
    time.sleep(1.0)
    prof = EngineProfile.objects.create(
        name="echo-8", engine="echo", gpus_per_node=8, args=["--load-seconds", "0.2"], startup_timeout_s=60
    )
    stop = threading.Event()

    def reconciler():
        try:
            while not stop.is_set():
                reconcile(now=timezone.now())
                stop.wait(RECONCILE_EVERY_S)
        finally:
            close_old_connections()

    t0 = time.monotonic()
    Deployment.objects.create(name="echo", served_model="echo-model", profile=prof, replicas=1)
    worker = threading.Thread(target=reconciler, daemon=True)
    worker.start()
    try:
        # Well inside one heartbeat interval: only the wakeup can deliver the StartShard this soon.
        deadline = t0 + INTERVAL_S - 5
        while not Replica.objects.filter(state="ready").exists():
            if time.monotonic() > deadline:
                pytest.fail(
                    f"no replica ready {INTERVAL_S - 5:g}s after the POST: "
                    f"{list(Replica.objects.values_list('state', 'reason'))}; gateway log: {gateway.tail()}"
                )
            time.sleep(0.02)
        elapsed = time.monotonic() - t0
    finally:
        stop.set()
        worker.join(timeout=10)
    print(f"\nreplica ready {elapsed:.2f} s after the POST (heartbeat interval {INTERVAL_S:g} s)")
    assert sum(a.listener.wakeups for a in agents) >= 1
