"""Scale to zero and back through a real gateway: the first request is held while a replica starts.

The reconciler runs here (as beat would), the node is simulated and echo
servers stand in for the shards (the agent's part played by the test, as in
the drain tests): a held request is answered once its replica is ready, a
model no node can take gets a 503 naming the planner's reason, and one
whose replica does not come in time a 503 once the hold's deadline passes.
"""

from __future__ import annotations

import threading

import httpx
import pytest
from django.utils import timezone

from gateway import notify
from inventory.heartbeat import touch
from placement.models import Deployment, EngineProfile, PlacementEvent, Replica
from placement.reconciler import reconcile
from tests.factories import make_node
from tests.gateway.conftest import make_key, wait_for
from tests.gateway.test_drain import _agent_stops, _ready

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

HOLD_S = 12


def autoscaled(name: str, profile: EngineProfile, replicas: int = 0) -> Deployment:
    return Deployment.objects.create(
        name=name,
        served_model=name,
        profile=profile,
        replicas=replicas,
        autoscale_metric="inflight",
        autoscale_min=0,
        autoscale_max=2,
        autoscale_target=4,
        scale_down_window_s=1,
    )


class Held(threading.Thread):
    """One chat request sent in the background; its answer kept."""

    def __init__(self, url: str, key: str, model: str) -> None:
        super().__init__(daemon=True)
        self.url, self.key, self.model = url, key, model
        self.response: httpx.Response | None = None

    def run(self) -> None:
        body = {"model": self.model, "messages": [{"role": "user", "content": "hello there"}]}
        self.response = httpx.post(
            f"{self.url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {self.key}"}, timeout=60
        )


def test_scale_to_zero_and_the_held_first_request(gateway_factory, echoes, user, settings):
    settings.LLMGW_GATEWAY_REFRESH = 1.0
    gateway = gateway_factory("autoscale", extra_env={"LLMGW_GATEWAY_HOLD_TIMEOUT": str(HOLD_S)})
    make_node("a", now=timezone.now(), gpus=8)
    one = EngineProfile.objects.create(name="echo-1", engine="echo", gpus_per_node=1)
    dep = autoscaled("chat", one)
    key = make_key(user)
    notify.publish("routes")
    # At zero replicas the model is still listed: a request for it starts one.
    wait_for(lambda: gateway.models(key).get("chat", {}).get("replicas") == 0, timeout=10, what=gateway.tail)

    first = Held(gateway.url, key, "chat")
    first.start()
    servers: dict[str, object] = {}

    def placed() -> bool:
        touch("a", now=timezone.now())
        reconcile(now=timezone.now())
        return Replica.objects.filter(deployment=dep, state="starting").exists()

    wait_for(placed, timeout=HOLD_S / 2, what=gateway.tail)
    assert first.response is None  # still held
    ev = PlacementEvent.objects.get(kind="autoscaled", deployment=dep)
    assert ev.reason == "1 requests waiting at zero replicas: 0 -> 1 replicas"
    _ready(dep, servers, echoes, timezone.now())
    first.join(timeout=HOLD_S)
    assert first.response is not None and first.response.status_code == 200, gateway.tail()
    assert first.response.json()["choices"][0]["message"]["content"]

    # Idle: back to zero after the window, drained as any scale-down, no request failed.
    def at_zero() -> bool:
        now = timezone.now()
        touch("a", now=now)
        reconcile(now=now)
        _agent_stops(servers, now)
        return not Replica.objects.filter(deployment=dep).exclude(state__in=["stopped", "failed"]).exists()

    wait_for(at_zero, timeout=30, what=lambda: str(list(Replica.objects.values_list("state", flat=True))))
    dep.refresh_from_db()
    assert dep.replicas == 0
    assert PlacementEvent.objects.filter(kind="autoscaled", deployment=dep).first().reason.startswith("no requests")

    # A model no node can take: the held request is answered with the planner's reason.
    big = EngineProfile.objects.create(name="echo-16", engine="echo", gpus_per_node=16)
    autoscaled("big", big)
    notify.publish("routes")
    wait_for(lambda: "big" in gateway.models(key), timeout=10, what=gateway.tail)
    refused = Held(gateway.url, key, "big")
    refused.start()

    def answered() -> bool:
        touch("a", now=timezone.now())
        reconcile(now=timezone.now())
        return refused.response is not None

    wait_for(answered, timeout=HOLD_S, what=gateway.tail)
    assert refused.response.status_code == 503
    assert refused.response.headers["retry-after"] == "10"
    message = refused.response.json()["error"]["message"]
    assert message.startswith("big: no replica can be placed: ") and "16" in message

    # A replica that does not come in time: a 503 once the hold's deadline passes (nothing reconciles here).
    autoscaled("late", one)
    notify.publish("routes")
    wait_for(lambda: "late" in gateway.models(key), timeout=10, what=gateway.tail)
    r = httpx.post(
        f"{gateway.url}/v1/chat/completions",
        json={"model": "late", "messages": [{"role": "user", "content": "hi"}]},
        headers={"Authorization": f"Bearer {key}"},
        timeout=HOLD_S * 3,
    )
    assert r.status_code == 503
    assert r.json()["error"]["message"].startswith(f"no replica ready within {HOLD_S} s; late: 0 of ")
    assert 'llmgw_gateway_hold_seconds_count{model="late",outcome="refused"} 1.0' in gateway.metrics()
