"""End to end: a deployment's replica is ready about two seconds after the POST, not a heartbeat interval later.

Two simulated H100 nodes (recorded hardware, fixture mode), each a real node
agent running its own loop with a 30 s heartbeat interval, configured with
nothing but the control plane (no `wakeup_url`, as `make demo` and a real
agent with no flag): the control plane names its gateway in its answers
(LLMGW_WAKEUP_URL), and the agents hold the wakeup long-poll open on that
real gateway process (granian, as `make run` starts it), with Redis and
without it (the embedded default, where the gateway reads the outbox).
Without the wakeup the replica could not be ready before the next heartbeat,
30 s away; with it the StartShard is fetched the moment its transaction
commits, and the shard's change to ready is reported the moment the agent
sees it. And `wakeup: false` in agent.yaml keeps an agent off it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
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


def simulated_agent(index: int, control_plane: str, workdir, token, **changes):
    """A real agent on a recorded HGX H100, configured as `make demo` configures it (no wakeup_url)."""
    from llmgw_agent import config as config_mod
    from llmgw_agent.loop import Agent, DiscoveryProbe
    from llmgw_sim.simulate import prepare_node

    node = prepare_node(
        index=index,
        profile="hgx-h100",
        workdir=workdir,
        control_plane=control_plane,
        token_file=token,
        heartbeat_interval=INTERVAL_S,
    )
    cfg = config_mod.load(str(node.config))
    assert cfg.wakeup_url == "" and cfg.wakeup is True
    cfg = dataclasses.replace(cfg, root=str(node.root), **changes)
    return Agent(cfg, probe=DiscoveryProbe(root=cfg.root, model_dirs=list(cfg.model_dirs)))


# Without Redis is `make run`'s embedded default: the end-to-end subset runs it on SQLite too.
@pytest.fixture(params=["redis", pytest.param("no-redis", marks=pytest.mark.e2e)])
def fleet(request, live_server, tmp_path, settings):
    settings.LLMGW_JOIN_TOKEN = JOIN
    settings.LLMGW_SHARD_PORT_BASE = free_port_range()
    if request.param == "redis" and not settings.REDIS_URL:
        pytest.skip("these settings have no Redis")
    no_redis = {"REDIS_URL": "", "LLMGW_VAR_DIR": str(tmp_path / "var")} if request.param == "no-redis" else {}
    gateway = Gateway(tmp_path, "gateway", extra_env=no_redis)
    gateway.start()
    # What the control plane tells every agent in its answers.
    settings.LLMGW_WAKEUP_URL = gateway.url
    token = tmp_path / "join-token"
    token.write_text(JOIN)
    agents, threads = [], []
    try:
        for i in range(2):
            agent = simulated_agent(i, live_server.url, tmp_path / "fleet", token)
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
    # Each polled the gateway the control plane named, not the control plane itself.
    assert {a.listener.url() for a in agents} == {gateway.url}


def test_wakeup_false_keeps_the_agent_to_its_heartbeats(live_server, tmp_path, settings, caplog):
    settings.LLMGW_JOIN_TOKEN = JOIN
    settings.LLMGW_WAKEUP_URL = "http://127.0.0.1:9"  # named, and still not polled
    token = tmp_path / "join-token"
    token.write_text(JOIN)
    agent = simulated_agent(0, live_server.url, tmp_path / "fleet", token, wakeup=False)
    thread = threading.Thread(target=agent.run, daemon=True)
    try:
        with caplog.at_level(logging.INFO, logger="llmgw.agent"):
            thread.start()
            deadline = time.monotonic() + 30
            while not agent.registered:
                assert time.monotonic() < deadline, "the agent never registered"
                time.sleep(0.05)
        assert agent.advertised_wakeup == "http://127.0.0.1:9"
        assert agent.listener is None
        assert (
            f"wakeup long-poll off (agent.yaml: wakeup: false): commands arrive with heartbeats, every {INTERVAL_S:g} s"
            in caplog.messages
        )
    finally:
        agent.close()
        thread.join(timeout=10)
