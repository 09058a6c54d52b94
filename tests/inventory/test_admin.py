"""The inventory admin: node list, actions with confirmations, node page, labels, permissions."""

import re
import uuid

import pytest
from django.contrib.admin.models import DELETION, LogEntry
from django.test import Client
from django.utils import timezone

from inventory.allocation import allocate
from inventory.models import Node, NodeEvent
from inventory.nodes import change_state
from tests.factories import make_node
from tests.inventory.cockpit_fixtures import card, ib_port, put_telemetry, replica_on

pytestmark = pytest.mark.django_db

LIST = "/admin/inventory/node/"


@pytest.fixture
def staff_viewer(viewer):
    viewer.is_staff = True
    viewer.save()
    return viewer


def login(user) -> Client:
    c = Client()
    c.force_login(user)
    return c


@pytest.fixture
def nodes(now):
    a = make_node("node-a", now=now, labels={"rack": "r1"}, fabrics=[{"name": "ib-a", "hcas": ["mlx5_0"]}])
    b = make_node("node-b", now=now, gpus=2, labels={"rack": "r2"})
    return a, b


def text(resp) -> str:
    return re.sub(r"\s+", " ", resp.content.decode())


def test_list_shows_state_gpus_fabrics_and_unreachable_on_a_cordoned_node(nodes, operator, now):
    allocate(node_id="node-a", replica_id=uuid.uuid4(), shard_id=uuid.uuid4(), gpu_indices=[0, 1])
    change_state("node-b", "cordoned", now=now)
    Node.objects.filter(id="node-b").update(unreachable_since=now)
    resp = login(operator).get(LIST)
    assert resp.status_code == 200
    body = text(resp)
    assert '<span class="lg-gpus">6/8</span> <span class="lg-dim">H100-80GB</span>' in body
    assert '<span class="lg-gpus">2/2</span>' in body
    assert ">ib-a<" in body
    row_b = body[body.index('href="/admin/inventory/node/node-b/change/"') :]
    row_b = row_b[: row_b.index("</tr>")]
    assert "lg-state-cordoned" in row_b
    assert '<span class="lg-state lg-state-unreachable">unreachable</span>' in row_b


def test_list_problem_count_includes_wear_from_telemetry(nodes, operator):
    put_telemetry("node-b", gpus=[{"index": 1, "wear": {"remap_failure": True}}])
    body = text(login(operator).get(LIST))
    assert 'title="GPU 1: out of spare memory rows: replace the card">1<' in body


def test_list_query_count_does_not_grow_with_nodes(nodes, operator, now, django_assert_max_num_queries):
    c = login(operator)
    c.get(LIST)
    with django_assert_max_num_queries(40) as small:
        c.get(LIST)
    for i in range(10):
        make_node(f"more-{i}", now=now, gpus=4, fabrics=[{"name": f"f{i}"}])
    with django_assert_max_num_queries(40) as big:
        c.get(LIST)
    assert len(big.captured_queries) == len(small.captured_queries)


@pytest.mark.parametrize(
    ("query", "shown", "hidden"),
    [
        ("state__exact=ready", ["node-a", "node-b"], []),
        ("fabric=ib-a", ["node-a"], ["node-b"]),
        ("label=rack%3Dr2", ["node-b"], ["node-a"]),
        ("gpu_class=H100-80GB", ["node-a", "node-b"], []),
        ("nvlink_domain=-", ["node-a", "node-b"], []),
        ("q=GPU-00000001", ["node-a", "node-b"], []),
        ("q=node-b.cluster", ["node-b"], ["node-a"]),
    ],
)
def test_list_filters_and_search(nodes, operator, query, shown, hidden):
    body = text(login(operator).get(f"{LIST}?{query}"))
    for n in shown:
        assert f'href="/admin/inventory/node/{n}/change/' in body
    for n in hidden:
        assert f'href="/admin/inventory/node/{n}/change/' not in body


def post_action(c, action, ids, **extra):
    return c.post(LIST, {"action": action, "_selected_action": ids, **extra})


def test_cordon_asks_first_then_records_who(nodes, operator):
    c = login(operator)
    resp = post_action(c, "cordon_nodes", ["node-a"])
    assert resp.status_code == 200
    assert "will be cordoned" in text(resp)
    assert Node.objects.get(id="node-a").state == "ready"
    resp = post_action(c, "cordon_nodes", ["node-a"], post="yes", reason="fan")
    assert resp.status_code == 302
    assert Node.objects.get(id="node-a").state == "cordoned"
    ev = NodeEvent.objects.filter(node_id="node-a", kind="state").latest("id")
    assert (ev.actor, ev.message) == (operator, "ready -> cordoned: fan")


def test_uncordon_reports_nodes_it_leaves_alone(nodes, operator, now):
    change_state("node-a", "cordoned", now=now)
    # Heard from just now: a silent node is never uncordoned.
    Node.objects.update(last_seen=timezone.now())
    c = login(operator)
    confirm = text(post_action(c, "uncordon_nodes", ["node-a", "node-b"]))
    assert "unchanged: already ready" in confirm
    resp = post_action(c, "uncordon_nodes", ["node-a", "node-b"], post="yes")
    assert resp.status_code == 302
    assert dict(Node.objects.values_list("id", "state")) == {"node-a": "ready", "node-b": "ready"}
    msgs = [str(m) for m in resp.wsgi_request._messages]
    assert msgs == ["uncordoned: node-a", "not changed: node-b: already ready"]


def test_drain_confirmation_lists_replicas_that_will_move_and_page_shows_progress(nodes, operator, now):
    replica = replica_on("node-a", now=now, deployment="llama")
    c = login(operator)
    confirm = text(post_action(c, "drain_nodes", ["node-a"]))
    assert f"<code>llama/{str(replica.id)[:8]}</code> (ready): rank 0 (ready, GPUs 0,1)" in confirm
    assert "1 replica will move." in confirm
    post_action(c, "drain_nodes", ["node-a"], post="yes")
    assert Node.objects.get(id="node-a").state == "draining"
    page = text(c.get("/admin/inventory/node/node-a/change/"))
    assert 'id="drain-progress" data-remaining="1"' in page
    assert "1 replica still to move" in page
    replica.shards.update(state="stopped")
    page = text(c.get("/admin/inventory/node/node-a/change/"))
    assert "Drain complete" in page


def test_viewer_sees_no_actions_and_cannot_post_them(nodes, staff_viewer):
    c = login(staff_viewer)
    body = text(c.get(LIST))
    assert "cordon_nodes" not in body and "drain_nodes" not in body
    for action in ["cordon_nodes", "uncordon_nodes", "drain_nodes", "forget_nodes"]:
        post_action(c, action, ["node-a"], post="yes")
    assert Node.objects.get(id="node-a").state == "ready"
    assert not NodeEvent.objects.filter(kind="state").exists()
    page = text(c.get("/admin/inventory/node/node-a/change/"))
    assert 'id="operator-labels"' not in page and "Drain…" not in page
    assert c.post("/admin/inventory/node/node-a/labels/", {"operator_labels": "x=y"}).status_code == 403
    assert Node.objects.get(id="node-a").operator_labels == {}


def test_non_staff_and_anonymous_are_sent_to_login(nodes, viewer):
    for c in (Client(), login(viewer)):
        for url in (LIST, "/admin/nvlink/", "/admin/fabrics/", "/admin/inventory/node/node-a/change/"):
            resp = c.get(url)
            assert resp.status_code == 302
            assert resp["Location"].startswith("/admin/login/")


def test_staff_without_view_permission_is_refused_the_cockpit_pages(nodes, django_user_model):
    user = django_user_model.objects.create_user("nobody", is_staff=True)
    c = login(user)
    assert c.get("/admin/nvlink/").status_code == 403
    assert c.get("/admin/fabrics/").status_code == 403
    assert c.get(LIST).status_code == 403


def test_forget_refused_while_holding_then_allowed(nodes, operator):
    allocate(node_id="node-a", replica_id=uuid.uuid4(), shard_id=uuid.uuid4(), gpu_indices=[0])
    c = login(operator)
    confirm = text(post_action(c, "forget_nodes", ["node-a", "node-b"]))
    assert "refused: node-a still holds 1 allocation" in confirm
    assert "drain it and wait for its replicas to move" in confirm
    assert "will be forgotten" in confirm
    resp = post_action(c, "forget_nodes", ["node-a", "node-b"], post="yes")
    assert list(Node.objects.values_list("id", flat=True)) == ["node-a"]
    assert [str(m) for m in resp.wsgi_request._messages] == [
        "forgotten: node-b",
        "refused: node-a still holds 1 allocation",
    ]
    entry = LogEntry.objects.get(action_flag=DELETION)
    assert (entry.user, entry.object_id) == (operator, "node-b")
    # Its history stays readable in the admin, with who forgot it.
    forgotten = NodeEvent.objects.get(kind="forgotten")
    assert (forgotten.node_id, forgotten.node_name, forgotten.actor) == (None, "node-b", operator)
    page = text(c.get("/admin/inventory/nodeevent/?q=node-b"))
    assert "node joined" in page and "forgotten (was ready)" in page


def test_node_page_sections(nodes, operator, now):
    put_telemetry(
        "node-b",
        gpus=[{"index": 0, "temp_c": 61, "power_w": 512, "power_limit_w": 700, "util_percent": 87}],
        ports=[ib_port("mlx5_0", sm="0x1", tx=2.5e9, rx=1e9)],
    )
    replica_on("node-b", now=now, deployment="qwen", gpus=(1,))
    allocate(node_id="node-b", replica_id=uuid.uuid4(), shard_id=uuid.uuid4(), gpu_indices=[1], memory_gb=64)
    page = text(login(operator).get("/admin/inventory/node/node-b/change/"))
    for section in ("labels", "gpus", "nvlink-matrix", "nvlink-domain", "ib-ports", "storage", "weights", "engines"):
        assert f'id="{section}"' in page
    assert "61 °C" in page and "512 / 700 W" in page and "87%" in page
    assert "<td>2.5 Gb/s</td><td>1.0 Gb/s</td>" in page
    assert "<td>qwen</td>" in page
    assert "<td>64 GB</td>" in page
    assert "Cannot be forgotten: node-b still holds 1 allocation and 1 shard not stopped." in page
    assert "Drain it and wait for its replicas to move" in page  # and what to do about it
    assert 'id="agent-labels"><code>rack=r2</code>' in page
    assert "node joined" in page  # history


def test_node_page_says_who_holds_each_card_and_what_is_not_reported(nodes, operator, now, django_user_model):
    put_telemetry("node-b", gpus=[{"index": 0, "memory_used_mb": 2}, {"index": 1}])
    rep = replica_on("node-b", now=now, deployment="qwen", gpus=(1,))
    shard = rep.shards.get()
    allocate(node_id="node-b", replica_id=rep.id, shard_id=shard.id, gpu_indices=[1])
    page = text(login(operator).get("/admin/inventory/node/node-b/change/"))
    # Which shard holds which card.
    assert '<td class="holder" data-holder=""><span class="lg-dim">free</span></td>' in page
    assert f'data-holder="qwen rank 0 · {str(rep.id)[:8]} (ready)"' in page
    # Memory in one form on every card, read or not.
    assert '<td class="memory">2 / 81559 MiB</td>' in page
    assert '<td class="memory">- / 81559 MiB</td>' in page
    # No topology recording: the matrix says so instead of a grid of dots.
    assert 'id="nvlink-not-reported"' in page and 'class="lg-matrix"' not in page
    # No Close/Delete bar; Forget is offered, and Django's delete is not a way around it.
    assert 'class="submit-row"' not in page and "deletelink" not in page
    assert 'id="forget-node"' in page
    root = django_user_model.objects.create_superuser("root", password="pw-root-1")
    assert login(root).get("/admin/inventory/node/node-b/delete/").status_code == 403
    assert "deletelink" not in text(login(root).get("/admin/inventory/node/node-b/change/"))


def test_node_page_draws_the_matrix_when_topology_was_reported(operator, now):
    make_node("tray", now=now, gpus=[card(i) for i in range(4)])
    page = text(login(operator).get("/admin/inventory/node/tray/change/"))
    assert 'class="lg-matrix"' in page and 'id="nvlink-not-reported"' not in page
    assert page.count('<td class="nv">NV</td>') == 12


def test_labels_editor_saves_and_removing_brings_agent_value_back(nodes, operator):
    c = login(operator)
    resp = c.post("/admin/inventory/node/node-a/labels/", {"operator_labels": "rack=r9\npool=batch"})
    assert resp.status_code == 302
    assert Node.objects.get(id="node-a").labels == {"rack": "r9", "pool": "batch"}
    c.post("/admin/inventory/node/node-a/labels/", {"operator_labels": "pool=batch"})
    assert Node.objects.get(id="node-a").labels == {"rack": "r1", "pool": "batch"}
    page = text(c.get("/admin/inventory/node/node-a/change/"))
    assert 'id="effective-labels"><code>pool=batch</code><code>rack=r1</code>' in page
    ev = NodeEvent.objects.filter(node_id="node-a", kind="labels").latest("id")
    assert (ev.actor, ev.data) == (operator, {"from": {"rack": "r9", "pool": "batch"}, "to": {"pool": "batch"}})


def test_labels_editor_names_the_bad_key(nodes, operator):
    resp = login(operator).post("/admin/inventory/node/node-a/labels/", {"operator_labels": "ok=1\nbad key=2"})
    assert resp.status_code == 400
    assert '<p class="lg-error" id="label-error">bad key: a label key is' in text(resp)
    assert Node.objects.get(id="node-a").operator_labels == {}


def test_nvlink_and_fabrics_pages_render_for_a_viewer(nodes, staff_viewer):
    c = login(staff_viewer)
    assert c.get("/admin/nvlink/").status_code == 200
    assert c.get("/admin/fabrics/").status_code == 200


def test_event_admin_is_read_only(nodes, operator):
    c = login(operator)
    ev = NodeEvent.objects.filter(node_id="node-a").first()
    assert c.get(f"/admin/inventory/nodeevent/{ev.id}/delete/").status_code == 403
    assert c.get("/admin/inventory/nodeevent/add/").status_code == 403


def test_nvlink_page_marks_each_tray_and_card(operator, now):
    from tests.inventory.cockpit_fixtures import nvlink_cluster

    nvlink_cluster(now)
    body = text(login(operator).get("/admin/nvlink/"))
    assert re.search(r'class="tray tray-joined" data-node="tray-joined" data-state="joined"', body)
    assert re.search(r'class="tray tray-out" data-node="tray-half" data-state="out"', body)
    assert re.search(r'class="tray tray-degraded" data-node="tray-degraded" data-state="degraded"', body)
    assert body.count('data-card-state="not-joined"') == 2
    assert body.count('data-card-state="degraded"') == 1
    assert (
        '<b>1</b>joined</span> <span class="lg-warn"><b>1</b>degraded</span> <span class="lg-bad"><b>1</b>out' in body
    )


def test_fabrics_page_shows_disagreement_and_failed_scan(operator, now):
    from inventory.fabric import set_scan

    make_node("n1", now=now, gpus=0, fabrics=[{"name": "ib", "hcas": ["mlx5_0", "mlx5_1"]}])
    put_telemetry("n1", ports=[ib_port("mlx5_0", sm="0x0a"), ib_port("mlx5_1", sm="0x0b")])
    key = "sm:0x000000000000000a"
    set_scan(key=key, at=now, node_id="n1", port="mlx5_0/1", output="Switch 36 ...", error="", took_s=2)
    set_scan(key=key, at=now, node_id="n1", port="mlx5_0/1", output="", error="ibnetdiscover timed out", took_s=120)
    body = text(login(operator).get("/admin/fabrics/"))
    assert (
        '<li data-node="n1"><code>n1</code> declares <code>ib</code> on mlx5_0, mlx5_1, cabled to '
        "<code>sm:0x000000000000000a</code> and <code>sm:0x000000000000000b</code></li>"
    ) in body
    assert "last try failed: ibnetdiscover timed out" in body
    assert "Switch 36 ..." in body


def test_node_page_credential_box_links_to_its_actions_for_an_operator(nodes, operator, now):
    from agents import credentials

    credentials.issue("node-a", now=now, issued_by="rack 7")
    c = login(operator)
    page = text(c.get("/admin/inventory/node/node-a/change/"))
    assert 'id="credential"' in page and 'id="credential-state">issued</span>' in page
    assert "(rack 7)" in page
    assert '<a class="button" href="/admin/agents/nodecredential/node-a/change/">Credential page</a>' in page
    assert '<a class="button" href="/admin/agents/nodecredential/?node=node-a">Reset or rotate…</a>' in page
    # The link lands on this node's credential alone, with both actions offered.
    listing = c.get("/admin/agents/nodecredential/?node=node-a")
    assert listing.status_code == 200
    assert [cred.node_id for cred in listing.context["cl"].result_list] == ["node-a"]
    assert '<option value="reset">' in text(listing) and '<option value="request_rotation">' in text(listing)
    assert c.get("/admin/agents/nodecredential/node-a/change/").status_code == 200
    # A node without a credential says so and offers nothing to act on.
    bare = text(c.get("/admin/inventory/node/node-b/change/"))
    assert 'id="credential-state">none</span>' in bare and 'id="credential-actions"' not in bare


def test_node_page_credential_box_has_no_actions_for_a_viewer(nodes, staff_viewer, now):
    from agents import credentials

    credentials.issue("node-a", now=now, issued_by="rack 7")
    page = text(login(staff_viewer).get("/admin/inventory/node/node-a/change/"))
    assert 'id="credential-state">issued</span>' in page
    assert 'id="credential-actions"' not in page and "Reset or rotate" not in page
    assert "/admin/agents/nodecredential/node-a/change/" not in page


def test_node_page_shows_where_prometheus_scrapes_the_agent(operator, now):
    make_node("node-m", now=now, metrics_addr="10.0.0.9:9400")
    page = text(login(operator).get("/admin/inventory/node/node-m/change/"))
    assert "Metrics address" in page
    assert "10.0.0.9:9400" in page
