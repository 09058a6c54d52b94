"""Scale-down and rolling update under steady load, through a real gateway: zero failed requests.

The reconciler runs here (as beat would run it), the replicas are echo
servers standing in for the shards, and the agent's part (stopping a shard
it is told to stop, reporting it) is played by the test: the echo server is
shut down the moment its StopShard is queued, so a request still running
there would fail.
"""

from __future__ import annotations

from collections.abc import Callable

import httpx
import pytest
from django.utils import timezone

from gateway import notify
from inventory.models import Command
from placement.models import Deployment, EngineProfile, Replica
from placement.reconciler import reconcile
from tests.factories import make_node, report_shard_state
from tests.gateway.conftest import Load, make_key, url_of, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def streamed_chats(url: str, key: str) -> Callable[[int, int], str]:
    """One streamed chat a call, through the gateway; the replica that answered it."""
    clients: dict[int, httpx.Client] = {}

    def request(worker: int, n: int) -> str:
        c = clients.get(worker)
        if c is None:
            c = clients[worker] = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=30)
        body = {
            "model": "chat",
            "stream": True,
            "messages": [{"role": "user", "content": f"worker {worker} turn {n} " + "w " * 8}],
        }
        with c.stream("POST", "/v1/chat/completions", json=body) as r:
            data = r.read()
            replica = r.headers.get("x-llmgw-replica", "")
        if r.status_code != 200 or not data.rstrip().endswith(b"data: [DONE]"):
            raise RuntimeError(f"HTTP {r.status_code}: {data[-200:]!r}")
        return replica

    return request


def _agent_stops(servers: dict[str, object], now) -> list[str]:
    """Play the agent: stop each shard told to stop (its echo server dies), and report it stopped."""
    done = []
    for cmd in Command.objects.filter(kind="stop_shard", acked_at__isnull=True):
        shard_id = cmd.payload["shard_id"]
        replica_id = cmd.payload["replica_id"]
        srv = servers.pop(replica_id, None)
        if srv is not None:
            assert srv.in_flight == 0, "a shard was stopped with requests still running"
            srv.shutdown()
            srv.server_close()
        report_shard_state(shard_id, "stopped", now=now, reason="stop requested")
        cmd.acked_at = now
        cmd.save(update_fields=["acked_at"])
        done.append(replica_id)
    return done


def _ready(dep, servers, echoes, now) -> None:
    """Mark the deployment's starting replicas ready, each served by a new echo server."""
    for rep in Replica.objects.filter(deployment=dep, state="starting"):
        for s in rep.shards.all():
            report_shard_state(s.id, "ready", now=now)
        srv = echoes(model="chat", token_seconds=0.01)
        servers[str(rep.id)] = srv
        Replica.objects.filter(id=rep.id).update(endpoint=url_of(srv))
    reconcile(now=now)
    notify.publish("routes")


def test_scale_down_and_rolling_update_fail_no_request(gateway_factory, echoes, user, settings):
    settings.LLMGW_GATEWAY_REFRESH = 1.0
    gateway = gateway_factory("drain", refresh_s=1.0)
    make_node("a", now=timezone.now(), gpus=8)
    profile = EngineProfile.objects.create(name="echo-1", engine="echo", gpus_per_node=1)
    dep = Deployment.objects.create(name="chat", served_model="chat", profile=profile, replicas=3)
    reconcile(now=timezone.now())
    servers: dict[str, object] = {}
    _ready(dep, servers, echoes, timezone.now())
    key = make_key(user)
    gateway.wait_ready(key, "chat", 3)

    def step_until(cond, what):
        def once():
            now = timezone.now()
            reconcile(now=now)
            _agent_stops(servers, now)
            return cond()

        wait_for(once, timeout=30, what=what)

    with Load(streamed_chats(gateway.url, key)) as load:
        wait_for(lambda: load.ok >= 20, timeout=20, what=lambda: f"load running: {load.ok} {load.failures[:3]}")
        # Scale down: one replica retires while requests run on it.
        dep.replicas = 2
        dep.save()
        step_until(lambda: Replica.objects.filter(deployment=dep, state="stopped").count() == 1, "scale-down done")
        gateway.wait_ready(key, "chat", 2)
        ok_after_scale = load.ok
        # Rolling update: a changed profile replaces the replicas one at a time.
        profile.args = ["--token-seconds", "0.01"]
        profile.save()
        for _ in range(2):
            step_until(lambda: Replica.objects.filter(deployment=dep, state="starting").exists(), "replacement placed")
            _ready(dep, servers, echoes, timezone.now())
            stopped = Replica.objects.filter(deployment=dep, state="stopped").count()
            step_until(
                lambda n=stopped: Replica.objects.filter(deployment=dep, state="stopped").count() >= n + 1,
                "old replica stopped",
            )
        wait_for(lambda: load.ok >= ok_after_scale + 20, timeout=20, what="load after the roll")
    assert load.failures == []
    assert load.ok > 40
    fps = set(Replica.objects.filter(deployment=dep, state="ready").values_list("profile_fp", flat=True))
    assert fps == {profile.fingerprint()}
    assert Replica.objects.filter(deployment=dep, state="ready").count() == 2
    assert Replica.objects.filter(deployment=dep, state="stopped").count() == 3
