"""The cockpit in a real headless Chromium, as an operator would use it.

Debian's chromium driven by Playwright; screenshots go to test-artifacts/
for a person to look at.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest
from django.conf import settings
from django.db import connections
from django.utils import timezone

from inventory.allocation import allocate
from inventory.models import GPU, Node, NodeEvent
from tests.factories import make_node
from tests.inventory.cockpit_fixtures import (
    CLUSTER,
    ib_port,
    nvlink_cluster,
    put_telemetry,
    recorded_cards,
    replica_on,
    tray,
)

CHROMIUM = "/usr/bin/chromium"
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
ARTIFACTS = Path(settings.BASE_DIR) / "test-artifacts"

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def browser(monkeypatch):
    if not os.path.exists(CHROMIUM):
        pytest.fail(f"{CHROMIUM} is missing: `make browser` installs Debian's chromium")
    from playwright.sync_api import sync_playwright

    # Playwright's sync API runs an event loop in this thread; the test's own
    # ORM calls between page steps are still plain synchronous code.
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        yield b
        # ORM calls made while Playwright's loop ran opened their own connection: close it,
        # or the test database cannot be dropped at the end of the run.
        connections.close_all()
        b.close()


def log_in(page, base: str, username: str, password: str, next_url: str) -> None:
    page.goto(f"{base}/admin/login/?next={next_url}")
    page.fill("#id_username", username)
    page.fill("#id_password", password)
    page.click("input[type=submit]")
    page.wait_for_url(f"{base}{next_url}*")


def test_operator_cordons_edits_labels_and_reads_the_racks(django_db_setup, live_server, browser, operator):
    now = timezone.now()
    nvlink_cluster(now)
    make_node(
        "node-a",
        now=now,
        labels={"rack": "r1"},
        fabrics=[{"name": "ib-compute", "hcas": ["mlx5_0"], "rate_gbps": 400}],
    )
    replica_on("node-a", now=now, deployment="llama-70b")
    put_telemetry(
        "node-a",
        gpus=[
            {"index": i, "temp_c": 50 + i, "power_w": 300 + 20 * i, "power_limit_w": 700, "util_percent": 10 * i}
            for i in range(8)
        ],
        ports=[
            ib_port("mlx5_0", sm="0x0002c90300a1b2c1", sms=[("0x0002c90300a1b2c1", "MASTER")], tx=4.2e10, rx=3.9e10)
        ],
    )
    page = browser.new_page(viewport={"width": 1440, "height": 900})
    base = live_server.url
    log_in(page, base, "operator", "pw-operator-1", "/admin/inventory/node/")

    # Cordon node-a from the list, through the confirmation page.
    page.check("input.action-select[value='node-a']")
    page.select_option("select[name=action]", "cordon_nodes")
    page.click("button[name=index]")
    page.wait_for_selector("#confirm-cordon")
    assert page.inner_text("#confirm-cordon tr[data-node='node-a']").split("\t")[-1].strip() == "will be cordoned"
    page.screenshot(path=str(ARTIFACTS / "cordon-confirm.png"), full_page=True)
    page.fill("#reason", "replacing a fan")
    page.click("#confirm")
    page.wait_for_selector("ul.messagelist")
    assert "cordoned: node-a" in page.inner_text("ul.messagelist").lower()
    row = page.locator("#result_list tr", has=page.locator("input[value='node-a']"))
    assert row.locator(".lg-state").first.inner_text().strip().lower() == "cordoned"
    page.screenshot(path=str(ARTIFACTS / "node-list.png"), full_page=True)
    assert Node.objects.get(id="node-a").state == "cordoned"
    ev = NodeEvent.objects.filter(node_id="node-a", kind="state").latest("id")
    assert (ev.actor_name, ev.message) == ("operator", "ready -> cordoned: replacing a fan")

    # Edit an operator label on the node page; the agent's stays visible beside it.
    page.click("#result_list a[href^='/admin/inventory/node/node-a/change/']")
    page.wait_for_selector("#operator-labels")
    page.fill("#operator-labels", "rack=r42\npool=batch")
    page.click("#save-labels")
    page.wait_for_selector("#effective-labels")
    assert page.locator("#effective-labels code").all_inner_texts() == ["pool=batch", "rack=r42"]
    assert page.locator("#agent-labels code").all_inner_texts() == ["rack=r1"]
    assert Node.objects.get(id="node-a").operator_labels == {"rack": "r42", "pool": "batch"}
    page.screenshot(path=str(ARTIFACTS / "node-page.png"), full_page=True)

    # The NVLink racks: one tray joined, one half joined, one degraded.
    page.goto(f"{base}/admin/nvlink/")
    rack = page.locator(f"section.rack[data-domain='{CLUSTER}/7']")
    assert rack.count() == 1
    states = {
        n: rack.locator(f".tray[data-node='{n}']").get_attribute("data-state")
        for n in ("tray-joined", "tray-half", "tray-degraded")
    }
    assert states == {"tray-joined": "joined", "tray-half": "out", "tray-degraded": "degraded"}
    half_cards = rack.locator(".tray[data-node='tray-half'] .chip")
    assert [half_cards.nth(i).get_attribute("data-card-state") for i in range(4)] == [
        "joined",
        "joined",
        "not-joined",
        "not-joined",
    ]
    # A card not joined really pulses: the browser runs the CSS animation.
    assert half_cards.nth(2).evaluate("e => getComputedStyle(e).animationName") == "nv-pulse"
    assert half_cards.nth(0).evaluate("e => getComputedStyle(e).animationName") == "none"
    degraded = rack.locator(".tray[data-node='tray-degraded'] .chip[data-card-state='degraded']")
    assert degraded.evaluate("e => getComputedStyle(e).backgroundColor") == "rgb(255, 176, 32)"
    assert "GPU 2 not joined" in rack.locator("[data-why='tray-half']").inner_text()
    assert "bandwidth degraded" in rack.locator("[data-why='tray-degraded']").inner_text()
    page.screenshot(path=str(ARTIFACTS / "nvlink.png"), full_page=True)

    page.goto(f"{base}/admin/fabrics/")
    assert page.locator(".fabric[data-key='sm:0x0002c90300a1b2c1'] .declared").inner_text().strip() == "ib-compute"
    page.screenshot(path=str(ARTIFACTS / "fabrics.png"), full_page=True)
    page.close()


def test_eight_racks_of_eighteen_trays_stay_readable(django_db_setup, live_server, browser, operator):
    now = timezone.now()
    nodes, gpus = [], []
    for r in range(8):
        domain_uuid = f"{r:08x}-0000-4000-8000-000000000000"
        for t in range(18):
            node_id = f"r{r}-t{t:02d}"
            bad = (r + t) % 11 == 0
            nodes.append(
                Node(
                    id=node_id,
                    hostname=node_id,
                    last_seen=now,
                    imex_state="DOWN" if (r + t) % 13 == 0 else "UP",
                    imex_channels=1,
                    nvlink_domain="" if bad else f"{domain_uuid}/1",
                )
            )
            for i in range(4):
                joined = not (bad and i == 3)
                gpus.append(
                    GPU(
                        node_id=node_id,
                        index=i,
                        uuid=str(uuid.uuid4()),
                        gpu_class="GB200-185GB",
                        fabric_state="Completed" if joined else "In Progress",
                        fabric_status="Success" if joined else "N/A",
                        cluster_uuid=domain_uuid,
                        clique_id="1",
                        fabric_bandwidth="Degraded" if (r + t) % 7 == 0 and i == 0 else "Full",
                    )
                )
    Node.objects.bulk_create(nodes)
    GPU.objects.bulk_create(gpus)
    page = browser.new_page(viewport={"width": 1600, "height": 1000})
    log_in(page, live_server.url, "operator", "pw-operator-1", "/admin/nvlink/")
    assert page.locator("section.rack").count() == 8
    assert page.locator(".tray").count() == 144
    # Every tray keeps room for its name and its four chips.
    widths = page.locator(".tray").evaluate_all("els => els.map(e => e.getBoundingClientRect().width)")
    assert min(widths) >= 140
    # Racks sit side by side, not one long column.
    tops = page.locator("section.rack").evaluate_all("els => els.map(e => Math.round(e.getBoundingClientRect().top))")
    assert len(set(tops)) <= 3
    page.screenshot(path=str(ARTIFACTS / "nvlink-8x18.png"), full_page=True)
    page.close()


def test_hardware_pages_read_as_an_operator_must(django_db_setup, live_server, browser, operator):
    """NVLink racks beside single-node machines, an allocated GB200, an H100 with XIDs, a replica, the node list."""
    now = timezone.now()
    nvlink_cluster(now)
    # A tray with a long name, as the demo's simulated racks name them.
    long_name = "sim-gb200-nvl72-rack01-tray01"
    tray(long_name, now=now)
    # The recorded 8-GPU HGX H100: one machine's NVSwitch, cluster UUID of zeros.
    make_node("hgx-h100-01", now=now, gpus=recorded_cards("h100-hgx-8gpu-excerpt.txt"))
    put_telemetry(
        "hgx-h100-01",
        gpus=[
            {"index": 3, "wear": {"xid_errors": 2, "last_xid": 79, "last_xid_text": "GPU has fallen off the bus"}},
            {"index": 5, "wear": {"xid_errors": 1, "last_xid": 31, "last_xid_text": "GPU memory page fault"}},
        ],
    )
    # An allocated GB200 tray: cards 0 and 1 held by a ready shard.
    rep = replica_on("tray-joined", now=now, deployment="llama-70b", gpus=(0, 1))
    shard = rep.shards.get()
    allocate(node_id="tray-joined", replica_id=rep.id, shard_id=shard.id, gpu_indices=[0, 1])
    put_telemetry("tray-joined", gpus=[{"index": i, "memory_used_mb": 2 + 90000 * (i < 2)} for i in range(3)])

    page = browser.new_page(viewport={"width": 1440, "height": 900})
    base = live_server.url
    log_in(page, base, "operator", "pw-operator-1", "/admin/nvlink/")

    # NVLink: the multi-node rack, and the HGX apart, neutral, not "not joined".
    rack = page.locator(f"section.rack[data-domain='{CLUSTER}/7']")
    assert rack.locator(".tray").count() == 4
    assert page.locator("section.rack").count() == 1
    assert page.locator(".tray[data-node='hgx-h100-01']").count() == 0
    machine = page.locator("#single-node-machines tr[data-machine='hgx-h100-01']")
    assert machine.inner_text().split("\t") == ["hgx-h100-01", "8 x H100-80GB", "ready"]
    assert "not joined" not in page.locator("#single-node-machines").inner_text()
    assert "no multi-node domain, by design" in page.locator("#single-node-machines").inner_text()
    # Whole names: the tray's name and the domain are not cut.
    name = rack.locator(f".tray[data-node='{long_name}'] a.node")
    assert name.inner_text() == long_name
    assert name.evaluate("e => e.scrollWidth <= e.clientWidth")
    assert rack.locator(".rack-head .name").inner_text() == f"{CLUSTER} / clique 7"
    page.screenshot(path=str(ARTIFACTS / "nvlink-racks-and-machines.png"), full_page=True)

    # The allocated GB200: who holds which card, memory in one form.
    page.goto(f"{base}/admin/inventory/node/tray-joined/change/")
    rows = page.locator("#gpus tbody tr")
    holders = [rows.nth(i).locator("td.holder").inner_text() for i in range(4)]
    held = f"llama-70b rank 0 · {str(rep.id)[:8]} (ready)"
    assert holders == [held, held, "free", "free"]
    memory = [rows.nth(i).locator("td.memory").inner_text() for i in range(4)]
    assert memory == ["90002 / 189471 MiB", "90002 / 189471 MiB", "2 / 189471 MiB", "- / 189471 MiB"]
    assert page.locator("#nvlink-matrix td.nv").count() == 12
    assert page.locator(".submit-row").count() == 0 and page.locator("a.deletelink").count() == 0
    assert page.locator("#forget-node").inner_text() == "Forget…"
    page.screenshot(path=str(ARTIFACTS / "node-gb200-allocated.png"), full_page=True)

    # The H100 with XIDs: a hardware XID is never beside "healthy"; an application XID points at the engine.
    page.goto(f"{base}/admin/inventory/node/hgx-h100-01/change/")
    gpu3 = page.locator("#gpus tbody tr[data-gpu='3']")
    gpu5 = page.locator("#gpus tbody tr[data-gpu='5']")
    assert gpu3.locator("td.health").inner_text() != "healthy"
    assert "hardware or driver fault: drain and reboot the node" in gpu3.inner_text()
    assert gpu5.locator("td.health").inner_text() == "healthy"
    assert "application fault: look at the engine's process" in gpu5.inner_text()
    # The hardware XID reads red, the application one amber.
    assert gpu3.locator("td.wear span").get_attribute("class") == "lg-bad"
    assert gpu5.locator("td.wear span").get_attribute("class") == "lg-warn"
    assert "not reported" in page.locator("#nvlink-matrix").inner_text()
    assert page.locator("#nvlink-matrix .lg-matrix").count() == 0
    page.screenshot(path=str(ARTIFACTS / "node-h100-xid.png"), full_page=True)

    # The replica: a view of what the reconciler owns, with its actions.
    page.goto(f"{base}/admin/placement/replica/{rep.pk}/change/")
    assert page.locator("h1").first.inner_text() == "View replica"
    assert page.locator("#ask-planner").text_content() == "Ask the planner"
    assert page.locator("#retire-replica").text_content() == "Retire…"
    assert page.locator("input[name=_save]").count() == 0 and page.locator("a.deletelink").count() == 0
    assert page.locator("[data-replica-state]").get_attribute("data-replica-state") == "ready"
    page.screenshot(path=str(ARTIFACTS / "replica.png"), full_page=True)

    # The node list at 1440 px: every column in view, one line per node.
    page.goto(f"{base}/admin/inventory/node/")
    assert page.evaluate("document.documentElement.scrollWidth") <= 1440
    problems = page.locator("#result_list thead th.column-problems_column")
    assert problems.evaluate("e => e.getBoundingClientRect().right") <= 1440
    row = page.locator("#result_list tbody tr", has=page.locator(f"a:text-is('{long_name}')"))
    heights = row.locator("th, td").evaluate_all("els => els.map(e => e.getBoundingClientRect().height)")
    id_height = row.locator("th").evaluate("e => e.getBoundingClientRect().height")
    assert id_height <= min(heights) + 1
    assert row.locator("th a").evaluate("e => e.getClientRects().length") == 1
    page.screenshot(path=str(ARTIFACTS / "node-list-1440.png"), full_page=True)
    page.close()
