"""POST /api/v1/agent/lease in the gateway's ASGI process: batched renewals with the Django endpoint's guarantees."""

from __future__ import annotations

import asyncio
import datetime as dt
import json

import httpx
import psycopg
import pytest
from django.utils import timezone

import agents.lease
import llmgw_wire as wire
from agents import credentials
from agents.lease import MAX_LEASE_BODY
from agents.lease_asgi import LEASE_PATH, LeaseEndpoint, LeaseWriter, with_agent_lease
from agents.models import NodeCredential
from inventory import outbox, telemetry
from inventory.models import Command, Node, NodeEvent
from tests.agents.test_lease import agent_config, to_django
from tests.factories import make_node
from tests.gateway.conftest import database_url

pytestmark = pytest.mark.django_db(transaction=True)


async def _inner(scope, receive, send):
    """What the rest of the gateway would answer: everything that is not the lease."""
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 299, "headers": []})
    await send({"type": "http.response.body", "body": b"gateway"})


def lease(node_id: str, **extra) -> dict:
    return {"node_id": node_id, "at": 1_800_000_000.0, **extra}


Request = tuple[str | None, object]


def send_all(requests: list[Request], *, window_s: float = 0.05, content_type: str = "application/json", method="POST"):
    """Send every (token, body) at once to a fresh endpoint; (the answers, in order, and the batches written)."""
    endpoint = LeaseEndpoint(window_s=window_s)
    app = with_agent_lease(_inner, endpoint=endpoint)

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as client:

            def one(token, body):
                headers = {"Content-Type": content_type}
                if token:
                    headers["Authorization"] = f"Bearer {token}"
                data = body if isinstance(body, bytes) else json.dumps(body).encode()
                return client.request(method, LEASE_PATH, content=data, headers=headers)

            answers = await asyncio.gather(*(one(t, b) for t, b in requests))
        batches = endpoint.writer.batches
        await endpoint.close()
        return answers, batches

    return asyncio.run(go())


def send(token: str | None, body, **kw) -> httpx.Response:
    return send_all([(token, body)], **kw)[0][0]


@pytest.fixture
def now():
    return timezone.now()


@pytest.fixture(autouse=True)
def _every_lease_checks_the_status(monkeypatch):
    # Production asks the cache on about one lease in STATUS_CHECK_EVERY; the tests, on every one.
    monkeypatch.setattr(agents.lease, "STATUS_CHECK_EVERY", 1)


@pytest.fixture
def nodes(now):
    """Three nodes, each with its credential and a status the control plane holds."""
    for n in ("gpu-a", "gpu-b", "gpu-c"):
        make_node(n, now=now)
        telemetry.put(n, {"at": 1.0})
    return {n: credentials.issue(n, now=now, issued_by="test") for n in ("gpu-a", "gpu-b", "gpu-c")}


def _age(node_ids, *, state: str = "ready") -> dt.datetime:
    old = timezone.now() - dt.timedelta(hours=1)
    Node.objects.filter(id__in=node_ids).update(last_seen=old, state=state, unreachable_since=old)
    return old


def test_leases_arriving_together_are_one_batch_and_each_renews_its_node(nodes):
    old = _age(nodes)
    answers, batches = send_all([(cred, lease(n)) for n, cred in nodes.items()])
    assert [a.status_code for a in answers] == [200, 200, 200]
    assert batches == 1
    for a in answers:
        answer = wire.LeaseResponse.model_validate_json(a.content)
        assert (answer.commands, answer.again, answer.rotate_credential) == ([], False, None)
    assert all(
        seen > old and since is None for seen, since in Node.objects.values_list("last_seen", "unreachable_since")
    )


def test_other_paths_pass_through(nodes):
    async def go():
        app = with_agent_lease(_inner, endpoint=LeaseEndpoint(window_s=0.01))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as client:
            r = await client.post("/v1/chat/completions", content=b"{}")
        await app.lease_endpoint.close()
        return r

    r = asyncio.run(go())
    assert (r.status_code, r.content) == (299, b"gateway")


def test_a_node_writes_only_its_own_lease(nodes, now):
    old = _age(nodes)
    mine = outbox.enqueue("gpu-a", wire.InstallEngine(engine="sglang"), now=now)
    # gpu-b's credential on gpu-a's lease (acknowledging gpu-a's command), beside gpu-c's own lease.
    answers, batches = send_all(
        [(nodes["gpu-b"], lease("gpu-a", acks=[str(mine.id)])), (nodes["gpu-c"], lease("gpu-c"))]
    )
    assert [a.status_code for a in answers] == [403, 200]
    assert answers[0].json() == {"detail": "this credential does not authorise requests about that node", "errors": []}
    assert batches == 1
    assert Node.objects.get(id="gpu-a").last_seen == old
    assert Node.objects.get(id="gpu-b").last_seen == old
    assert Node.objects.get(id="gpu-c").last_seen > old
    assert Command.objects.get(id=mine.id).acked_at is None


def test_no_credential_or_an_unknown_one_is_401(nodes):
    for token in (None, "llmgw-node-unknown", "something-else"):
        r = send(token, lease("gpu-a"))
        assert r.status_code == 401, token
        assert r.headers["www-authenticate"] == 'Bearer realm="llmgw-agent"'
        assert r.json() == {"detail": "missing or invalid credentials", "errors": []}


def test_a_revoked_credential_is_refused_at_the_next_batch(nodes, now):
    # The writer is kept across the revocation: no copy of the credential outlives it.
    endpoint = LeaseEndpoint(window_s=0.01)
    app = with_agent_lease(_inner, endpoint=endpoint)
    headers = {"Authorization": f"Bearer {nodes['gpu-a']}", "Content-Type": "application/json"}
    body = json.dumps(lease("gpu-a")).encode()

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as client:
            before = await client.post(LEASE_PATH, content=body, headers=headers)
            await asyncio.to_thread(credentials.reset, "gpu-a", now=now)
            after = await client.post(LEASE_PATH, content=body, headers=headers)
        await endpoint.close()
        return before.status_code, after.status_code

    old = _age(["gpu-a"])
    assert asyncio.run(go()) == (200, 401)
    # The refused lease renewed nothing: last_seen is the first lease's.
    seen = Node.objects.get(id="gpu-a").last_seen
    assert seen > old


def test_refusals_come_in_the_order_of_every_agent_endpoint(nodes):
    assert send("llmgw-node-wrong", b"{not json").status_code == 401
    assert send(None, b"{not json").status_code == 401
    r = send(nodes["gpu-a"], {"at": 1.0})
    assert r.status_code == 400 and r.json()["errors"][0]["field"] == "node_id"
    assert send(nodes["gpu-a"], lease("gpu-a", acks=["x"] * (wire.MAX_COMMANDS + 1))).status_code == 400
    assert send(nodes["gpu-a"], lease("gpu-a", padding="x" * MAX_LEASE_BODY)).status_code == 413
    assert send(nodes["gpu-a"], b"x", content_type="text/plain").status_code == 415
    # A bad body with an unknown credential: the credential's refusal first.
    assert send("llmgw-node-wrong", b"x", content_type="text/plain").status_code == 401
    r = send(nodes["gpu-a"], b"", method="GET")
    assert (r.status_code, r.headers["allow"]) == (405, "POST")


def test_waiting_commands_are_carried_and_acks_applied(nodes, now):
    done = outbox.enqueue("gpu-a", wire.InstallEngine(engine="sglang"), now=now)
    waiting = outbox.enqueue("gpu-a", wire.InstallEngine(engine="vllm"), now=now + dt.timedelta(seconds=1))
    answers, batches = send_all(
        [(nodes["gpu-a"], lease("gpu-a", acks=[str(done.id), "not-a-uuid"])), (nodes["gpu-b"], lease("gpu-b"))]
    )
    assert batches == 1
    a = wire.LeaseResponse.model_validate_json(answers[0].content)
    assert ([c.id for c in a.commands], a.again) == ([str(waiting.id)], False)
    assert wire.LeaseResponse.model_validate_json(answers[1].content).commands == []
    assert Command.objects.get(id=done.id).acked_at is not None
    row = Command.objects.get(id=waiting.id)
    assert (row.deliveries, row.acked_at) == (1, None)


def test_a_batch_costs_two_statements_however_many_of_its_nodes_have_commands_waiting(nodes, now):
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from agents.lease_asgi import write_batch
    from inventory import lease as lease_db

    made = {
        n: [
            outbox.enqueue(n, wire.InstallEngine(engine=f"{n}-{i}"), now=now + dt.timedelta(seconds=i))
            for i in range(k)
        ]
        for n, k in (("gpu-a", 2), ("gpu-b", 1))
    }
    asks = [lease_db.Ask(node_id=n, token_hash=credentials.hash_secret(c)) for n, c in nodes.items()]
    with CaptureQueriesContext(connection) as q:
        answers = write_batch(asks)
    # The renewal of all three, then the commands of the two with some: a statement each, not one per node.
    assert [x["sql"].split(" ", 1)[0] for x in q.captured_queries] == ["WITH", "WITH"]
    assert "row_number()" in q.captured_queries[1]["sql"]
    got = {n: [c.id for c in a.commands] for n, a in answers.items()}
    assert got == {"gpu-a": [str(c.id) for c in made["gpu-a"]], "gpu-b": [str(made["gpu-b"][0].id)], "gpu-c": []}
    assert sorted(Command.objects.values_list("deliveries", flat=True)) == [1, 1, 1]
    # A lease refused for its credential takes none of its node's commands.
    deliveries = dict(Command.objects.values_list("id", "deliveries"))
    answers = write_batch([lease_db.Ask(node_id="gpu-a", token_hash=credentials.hash_secret(nodes["gpu-b"]))])
    assert answers == {}
    assert dict(Command.objects.values_list("id", "deliveries")) == deliveries
    # No command waits: the renewal alone.
    Command.objects.update(acked_at=now)
    with CaptureQueriesContext(connection) as q:
        answers = write_batch(asks)
    assert len(q.captured_queries) == 1
    assert {n: a.commands for n, a in answers.items()} == {"gpu-a": [], "gpu-b": [], "gpu-c": []}


def test_a_lost_status_is_asked_for(nodes):
    telemetry.forget("gpu-a")
    a = wire.LeaseResponse.model_validate_json(send(nodes["gpu-a"], lease("gpu-a")).content)
    assert (a.send_status, a.again) == (True, True)
    b = wire.LeaseResponse.model_validate_json(send(nodes["gpu-b"], lease("gpu-b")).content)
    assert (b.send_status, b.again) == (False, False)


def test_status_floors_in_a_batch_are_checked_against_the_status_held_in_one_round_trip(nodes, monkeypatch):
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from agents.lease_asgi import write_batch
    from inventory import lease as lease_db

    telemetry.put("gpu-a", {"at": 1.0}, digest="da")
    telemetry.put("gpu-b", {"at": 1.0}, digest="db")
    # No lease asks the cache by chance here: what is asked is the floors'.
    monkeypatch.setattr(agents.lease, "STATUS_CHECK_EVERY", 10**9)
    checked = []
    real = lease_db.confirm_statuses
    monkeypatch.setattr(lease_db, "confirm_statuses", lambda floors: (checked.append(dict(floors)), real(floors))[1])
    hashes = {n: credentials.hash_secret(c) for n, c in nodes.items()}
    asks = [
        lease_db.Ask(node_id="gpu-a", token_hash=hashes["gpu-a"], status_digest="da"),
        lease_db.Ask(node_id="gpu-b", token_hash=hashes["gpu-b"], status_digest="an older one"),
        lease_db.Ask(node_id="gpu-c", token_hash=hashes["gpu-c"]),
    ]
    with CaptureQueriesContext(connection) as q:
        answers = write_batch(asks)
    # The floors cost the batch no statement: the renewal alone.
    assert len(q.captured_queries) == 1
    assert checked == [{"gpu-a": "da", "gpu-b": "an older one"}]
    got = {n: (a.send_status, a.again, a.status_confirmed) for n, a in answers.items()}
    assert got == {"gpu-a": (False, False, True), "gpu-b": (True, True, False), "gpu-c": (False, False, None)}
    # A floor whose credential is not its node's renews and confirms nothing.
    stranger = lease_db.Ask(node_id="gpu-a", token_hash=hashes["gpu-b"], status_digest="da")
    assert write_batch([stranger]) == {}


def test_a_floor_is_confirmed_over_http_as_at_the_control_plane(nodes):
    telemetry.put("gpu-a", {"at": 1.0}, digest="da")
    answers, _ = send_all([
        (nodes["gpu-a"], lease("gpu-a", status_digest="da")),
        (nodes["gpu-b"], lease("gpu-b", status_digest="da")),
    ])  # fmt: skip
    a, b = (wire.LeaseResponse.model_validate_json(x.content) for x in answers)
    assert (a.send_status, a.status_confirmed) == (False, True)
    assert (b.send_status, b.again, b.status_confirmed) == (True, True, False)


def test_more_commands_than_an_answer_carries_says_again(nodes, now):
    Command.objects.bulk_create(
        Command(node_id="gpu-a", kind="install_engine", payload={"engine": f"e{i}"}, created_at=now)
        for i in range(wire.MAX_COMMANDS + 1)
    )
    a = wire.LeaseResponse.model_validate_json(send(nodes["gpu-a"], lease("gpu-a")).content)
    assert (len(a.commands), a.again) == (wire.MAX_COMMANDS, True)


def test_an_unreachable_or_lost_node_comes_back_to_ready_with_its_event(nodes):
    for state in ("unreachable", "lost"):
        events = NodeEvent.objects.filter(node_id="gpu-a", kind="state").count()
        _age(["gpu-a"], state=state)
        assert send(nodes["gpu-a"], lease("gpu-a")).status_code == 200
        node = Node.objects.get(id="gpu-a")
        assert (node.state, node.unreachable_since) == ("ready", None)
        event = NodeEvent.objects.filter(node_id="gpu-a", kind="state").latest("id")
        assert NodeEvent.objects.filter(node_id="gpu-a", kind="state").count() == events + 1
        assert (event.message, event.data, event.actor_name) == (
            f"{state} -> ready: heartbeat resumed",
            {"from": state, "to": "ready", "reason": "heartbeat resumed"},
            "agent",
        )


def test_a_rotation_finishes_when_the_new_secret_renews(nodes, now):
    assert credentials.request_rotation("gpu-a", now=now)
    old_secret = nodes["gpu-a"]
    assert send(old_secret, lease("gpu-a")).json()["rotate_credential"] is True
    new = credentials.rotate("gpu-a", now=now)
    # Until the new secret is used, the old one still renews.
    assert send(old_secret, lease("gpu-a")).status_code == 200
    assert send(new, lease("gpu-a")).json()["rotate_credential"] is None
    assert NodeCredential.objects.get(node_id="gpu-a").previous_hash is None
    assert send(old_secret, lease("gpu-a")).status_code == 401


def test_a_node_twice_in_one_window_is_written_in_two_batches(nodes):
    answers, batches = send_all([(nodes["gpu-a"], lease("gpu-a")), (nodes["gpu-a"], lease("gpu-a"))])
    assert [a.status_code for a in answers] == [200, 200]
    assert batches == 2


def test_a_database_failure_answers_503_and_the_next_batch_is_written(nodes, monkeypatch):
    import agents.lease_asgi as mod

    real = mod.lease_db.renew_batch
    calls = []

    def failing_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("the database went away")
        return real(*args, **kwargs)

    monkeypatch.setattr(mod.lease_db, "renew_batch", failing_once)
    writer = LeaseWriter(window_s=0.01)
    endpoint = LeaseEndpoint(writer=writer)
    app = with_agent_lease(_inner, endpoint=endpoint)
    headers = {"Authorization": f"Bearer {nodes['gpu-a']}", "Content-Type": "application/json"}

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as client:
            first = await client.post(LEASE_PATH, content=json.dumps(lease("gpu-a")), headers=headers)
            second = await client.post(LEASE_PATH, content=json.dumps(lease("gpu-a")), headers=headers)
        await endpoint.close()
        return first, second

    first, second = asyncio.run(go())
    assert (first.status_code, first.json()["detail"]) == (503, "the lease could not be written; send it again")
    assert second.status_code == 200


# --- a real agent: the gateway's endpoint when named, the control plane's when it fails ---------


@pytest.fixture
def gateway(settings):
    """The gateway's lease endpoint on an event loop of its own thread (the agent is synchronous), named
    to agents as http://gw; call it with an agent's request for the gateway's answer."""
    import threading

    settings.LLMGW_LEASE_URL = "http://gw/api/v1/agent/lease"
    endpoint = LeaseEndpoint(window_s=0.005)
    app = with_agent_lease(_inner, endpoint=endpoint)
    loop = asyncio.new_event_loop()
    runner = threading.Thread(target=loop.run_forever, daemon=True)
    runner.start()

    async def through(request: httpx.Request) -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as gw:
            r = await gw.post(request.url.path, content=request.content, headers=dict(request.headers))
        return httpx.Response(r.status_code, content=r.content, headers={"Content-Type": "application/json"})

    yield lambda request: asyncio.run_coroutine_threadsafe(through(request), loop).result(10)
    asyncio.run_coroutine_threadsafe(endpoint.close(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    runner.join(5)
    loop.close()


def test_an_agent_sends_leases_to_the_named_gateway_and_falls_back_when_it_fails(client, join_token, gateway, tmp_path):
    from llmgw_agent.loop import LEASE_FALLBACK_S, Agent
    from tests.llmgw_agent.test_loop import Probe

    gateway_up = [True]
    seen: list[str] = []

    def route(request: httpx.Request) -> httpx.Response:
        seen.append(f"{request.url.host}{request.url.path}")
        if request.url.host == "gw":
            if not gateway_up[0]:
                raise httpx.ConnectError("connection refused", request=request)
            return gateway(request)
        return to_django(client, request)

    now = [1_000.0]
    cfg = agent_config(join_token, tmp_path)
    http = httpx.Client(base_url="http://cp", transport=httpx.MockTransport(route))
    agent = Agent(cfg, probe=Probe(), http=http, listening=lambda: [22], clock=lambda: now[0])
    try:
        agent.step()
        agent.step()
        assert seen == ["cp/api/v1/agent/register", "cp/api/v1/agent/heartbeat", "gw/api/v1/agent/lease"]
        assert agent.advertised_lease == "http://gw/api/v1/agent/lease"
        # A command waits: the gateway's answer carries it; applying it changes the engine installs,
        # so its ack rides in a status (to the control plane).
        cmd = outbox.enqueue("node-a", wire.InstallEngine(engine="sglang"), now=timezone.now())
        seen.clear()
        agent.heartbeat()
        assert seen == ["gw/api/v1/agent/lease"] and "sglang" in agent.installs
        agent.heartbeat()
        assert seen[-1] == "cp/api/v1/agent/heartbeat"
        assert Command.objects.get(id=cmd.id).acked_at is not None
        # The gateway goes away: this lease goes to the control plane at once, and the next ones too.
        gateway_up[0] = False
        seen.clear()
        before = Node.objects.get(id="node-a").last_seen
        agent.heartbeat()
        assert seen == ["gw/api/v1/agent/lease", "cp/api/v1/agent/lease"]
        assert Node.objects.get(id="node-a").last_seen > before
        seen.clear()
        now[0] += 5
        agent.heartbeat()
        assert seen == ["cp/api/v1/agent/lease"]
        # After LEASE_FALLBACK_S the gateway is tried again.
        gateway_up[0] = True
        now[0] += LEASE_FALLBACK_S
        seen.clear()
        agent.heartbeat()
        # (A status is due at least once a minute: that one goes to the control plane.)
        agent.heartbeat()
        assert seen[-1] == "gw/api/v1/agent/lease"
    finally:
        agent.close()


def test_a_status_waiting_in_the_web_tiers_queue_does_not_leave_its_node_silent(client, join_token, gateway, tmp_path):
    # A status held at the control plane (its web tier busy): the agent renews through the gateway
    # meanwhile, so the liveness sweep reads a node heard, not one silent for the whole wait.
    import threading

    from llmgw_agent.loop import Agent
    from tests.llmgw_agent.test_loop import Probe

    hold = threading.Event()
    leased = threading.Event()
    seen: list[tuple[str, dict]] = []
    during_hold: list[tuple[str, dt.datetime]] = []

    def route(request: httpx.Request) -> httpx.Response:
        seen.append((f"{request.url.host}{request.url.path}", json.loads(request.content)))
        if request.url.host == "gw":
            r = gateway(request)
            if hold.is_set():
                leased.set()
            return r
        if hold.is_set() and request.url.path == "/api/v1/agent/heartbeat":
            # The web tier's queue: this status is answered only once a lease got through meanwhile.
            assert leased.wait(10), "no lease while the status waited"
            node = Node.objects.get(id="node-a")
            during_hold.append((node.state, node.last_seen))
        return to_django(client, request)

    cfg = agent_config(join_token, tmp_path)
    http = httpx.Client(base_url="http://cp", transport=httpx.MockTransport(route))
    agent = Agent(cfg, probe=Probe(), http=http, listening=lambda: [22])
    try:
        # Registration and the first status, answered at once: no lease goes beside them.
        agent.keepalive.after_s = 60.0
        agent.step()
        assert [p for p, _ in seen] == ["cp/api/v1/agent/register", "cp/api/v1/agent/heartbeat"]
        assert agent.keepalive.sent == 0
        # The next status waits: a lease renews the node meanwhile, carrying no acks.
        old = _age(["node-a"], state="ready")
        Node.objects.filter(id="node-a").update(unreachable_since=None)
        agent.keepalive.after_s = 0.05
        agent.status.reset()
        seen.clear()
        hold.set()
        assert isinstance(agent.heartbeat(), wire.HeartbeatResponse)
        hold.clear()
        assert seen[0][0] == "cp/api/v1/agent/heartbeat"
        assert [(p, body["node_id"], body.get("acks", [])) for p, body in seen[1:2]] == [
            ("gw/api/v1/agent/lease", "node-a", [])
        ]
        ((state, last_seen),) = during_hold
        assert (state, last_seen > old) == ("ready", True)
        assert agent.keepalive.sent >= 1
    finally:
        agent.close()


def test_an_agent_whose_gateway_does_not_answer_sends_its_lease_to_the_control_plane_after_the_lease_timeout(
    client, join_token, settings, tmp_path
):
    # A gateway that accepts and never answers (its event loop busy): the lease may not wait the
    # client's whole timeout, or every agent renewing through it falls silent at once.
    import socket
    import threading

    from llmgw_agent.loop import LEASE_FALLBACK_S, LEASE_TIMEOUT_S, Agent
    from tests.llmgw_agent.test_loop import Probe

    stalled = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                held.append(stalled.accept()[0])
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    settings.LLMGW_LEASE_URL = f"http://127.0.0.1:{stalled.getsockname()[1]}{LEASE_PATH}"
    seen: list[tuple[str, float | None]] = []
    real = httpx.HTTPTransport()

    class Split(httpx.BaseTransport):
        # The stalled gateway over a real socket; the control plane through Django's test client.
        def handle_request(self, request: httpx.Request) -> httpx.Response:
            seen.append((f"{request.url.host}{request.url.path}", request.extensions["timeout"]["read"]))
            if request.url.host == "127.0.0.1":
                return real.handle_request(request)
            return to_django(client, request)

    now = [1_000.0]
    cfg = agent_config(join_token, tmp_path)
    agent = Agent(
        cfg,
        probe=Probe(),
        http=httpx.Client(base_url="http://cp", transport=Split(), timeout=30.0),
        listening=lambda: [22],
        clock=lambda: now[0],
    )
    try:
        agent.step()
        before = Node.objects.get(id="node-a").last_seen
        seen.clear()
        assert isinstance(agent.heartbeat(), wire.LeaseResponse)
        # Tried on the gateway with the lease's own timeout, then renewed by the control plane.
        assert seen == [("127.0.0.1" + LEASE_PATH, LEASE_TIMEOUT_S), ("cp" + LEASE_PATH, 30.0)]
        assert Node.objects.get(id="node-a").last_seen > before
        assert agent.lease_fallback_until == now[0] + LEASE_FALLBACK_S
        assert len(held) == 1
    finally:
        agent.close()
        stalled.close()
        for conn in held:
            conn.close()


@pytest.mark.slow
def test_a_real_agent_renews_through_the_real_gateway_process_and_falls_back_when_it_stops(
    live_server, tmp_path, settings
):
    # The gateway as `make run` starts it (gateway.native), the control plane a live server.
    from llmgw_agent import config as config_mod
    from llmgw_agent.loop import Agent
    from tests.gateway.conftest import Gateway
    from tests.llmgw_agent.test_loop import Probe

    settings.LLMGW_JOIN_TOKEN = "lease-e2e-join-token"
    gateway = Gateway(tmp_path, "gateway")
    gateway.start()
    settings.LLMGW_LEASE_URL = gateway.url + LEASE_PATH
    cfg = config_mod.parse(
        {
            "control_plane": live_server.url,
            "join_token": "lease-e2e-join-token",
            "node_id": "node-e2e",
            "state_dir": str(tmp_path / "state"),
            "wakeup": False,
        }
    )
    agent = Agent(cfg, probe=Probe(), listening=lambda: [22])
    try:
        agent.step()
        assert agent.advertised_lease == gateway.url + LEASE_PATH
        old = _age(["node-e2e"], state="unreachable")
        # A lease (nothing changed since the status), renewed by the gateway: no fallback began.
        assert isinstance(agent.heartbeat(), wire.LeaseResponse)
        node = Node.objects.get(id="node-e2e")
        assert (node.state, node.last_seen > old, agent.lease_fallback_until) == ("ready", True, 0.0)
        # The gateway stops: the lease goes to the control plane at once.
        gateway.stop()
        old = _age(["node-e2e"])
        assert isinstance(agent.heartbeat(), wire.LeaseResponse)
        assert Node.objects.get(id="node-e2e").last_seen > old
        assert agent.lease_fallback_until > agent.clock()
    finally:
        agent.close()
        gateway.stop()


def test_a_lease_whose_node_row_is_held_waits_for_it_without_holding_the_others(nodes):
    # One node's row held (its own full heartbeat in progress): the others of the batch are answered
    # at once; the held one goes into the next batches and is answered once the row is free.
    old = _age(nodes)
    endpoint = LeaseEndpoint(window_s=0.01)
    app = with_agent_lease(_inner, endpoint=endpoint)

    async def go():
        with psycopg.connect(database_url()) as holder:
            holder.execute("SELECT id FROM inventory_node WHERE id = 'gpu-b' FOR UPDATE")
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as client:

                def one(node_id: str):
                    headers = {"Authorization": f"Bearer {nodes[node_id]}"}
                    return asyncio.ensure_future(client.post(LEASE_PATH, json=lease(node_id), headers=headers))

                held, free = one("gpu-b"), one("gpu-a")
                answered = await asyncio.wait_for(free, 60)  # held behind the busy row, it would never come
                assert not held.done()
                # Read on the holder's own connection: the event loop's thread makes no ORM call.
                seen_while_held = dict(holder.execute("SELECT id, last_seen FROM inventory_node").fetchall())
                holder.rollback()
                late = await held
        batches = endpoint.writer.batches
        await endpoint.close()
        return answered, late, seen_while_held, batches

    answered, late, seen_while_held, batches = asyncio.run(go())
    assert (answered.status_code, late.status_code) == (200, 200)
    assert seen_while_held["gpu-a"] > old and seen_while_held["gpu-b"] == old
    assert Node.objects.get(id="gpu-b").last_seen > old
    assert batches >= 2
