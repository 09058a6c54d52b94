"""A registration costs a small, fixed number of SQL statements, whatever the node's size: a join storm is thousands."""

from __future__ import annotations

import datetime as dt
import re

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from agents import credentials
from agents.models import JoinToken, NodeCredential
from inventory.models import GPU, EngineInstall, FabricAttachment, LocalWeights, Node, NodeEvent, Storage
from tests.agents.conftest import post
from tests.factories import register_payload

pytestmark = pytest.mark.django_db

FABRICS = [{"name": "compute", "hcas": ["mlx5_0", "mlx5_1"], "rate_gbps": 400}]
STORAGE = [{"path": "/models", "free_bytes": 10**12, "total_bytes": 2 * 10**12, "shared": True, "fstype": "nfs"}]
WEIGHTS = [{"path": "/models/llama", "size_bytes": 10**10, "shared": True}]
INSTALLS = [
    {"engine": "vllm", "version": "0.11.0", "state": "ready"},
    {"engine": "sglang", "version": "0.5.2", "state": "ready"},
]


def _statements(client, body, token) -> list[str]:
    with CaptureQueriesContext(connection) as c:
        resp = post(client, "register", body, token)
    assert resp.status_code == 200, resp.content
    return [q["sql"] for q in c.captured_queries]


def test_a_new_node_is_written_one_statement_per_table(client, join_token, django_assert_num_queries):
    body = register_payload(
        "node-a", gpus=8, fabrics=FABRICS, storage=STORAGE, weights=WEIGHTS, engine_installs=INSTALLS
    )
    sql = _statements(client, body, join_token)
    writes = [s for s in sql if s.startswith(("WITH", "INSERT", "UPDATE", "DELETE"))]
    # One statement inserts everything, however many GPUs: one INSERT per table (the node's two
    # events, joined and credential issued, in one), joined as CTEs.
    assert len(writes) == 1
    inserts = re.findall(r'INSERT INTO "(\w+)"', writes[0])
    assert inserts == [
        "inventory_node",
        "inventory_nodeevent",
        "inventory_gpu",
        "inventory_fabricattachment",
        "inventory_storage",
        "inventory_localweights",
        "inventory_engineinstall",
        "agents_nodecredential",
    ]
    # Nothing of a new node is read back, updated or deleted first, nor its shards or commands read:
    # the savepoint pair of the test's transaction, the credential check, the node's row lock, the INSERT.
    assert len(sql) == 2 + 1 + 1 + 1
    # The node's row is locked before anything is written (two registrations of one node queue there).
    assert [s for s in sql if s.endswith("FOR UPDATE")] == [sql[2]]
    assert sql[2].startswith("SELECT ") and ' FROM "inventory_node" WHERE id = ' in sql[2]
    assert GPU.objects.filter(node_id="node-a").count() == 8
    assert list(EngineInstall.objects.filter(node_id="node-a").order_by("engine").values_list("engine", "state")) == [
        ("sglang", "ready"),
        ("vllm", "ready"),
    ]
    assert FabricAttachment.objects.get(node_id="node-a").hcas == ["mlx5_0", "mlx5_1"]
    assert Storage.objects.filter(node_id="node-a").count() == 1
    assert LocalWeights.objects.filter(node_id="node-a").count() == 1
    assert NodeCredential.objects.filter(node_id="node-a").count() == 1


def test_the_statement_count_does_not_grow_with_the_gpus(client, join_token):
    one = _statements(client, register_payload("node-a", gpus=1), join_token)
    eight = _statements(client, register_payload("node-b", gpus=8), join_token)
    assert len(one) == len(eight) == 2 + 1 + 1 + 1
    assert GPU.objects.filter(node_id="node-b").count() == 8


def test_a_re_registration_replaces_what_changed(client, join_token):
    body = register_payload("node-a", gpus=8, fabrics=FABRICS, engine_installs=INSTALLS)
    credential = post(client, "register", body, join_token).json()["credential"]
    body["gpus"] = body["gpus"][:6]
    body["gpus"][0]["name"] = "NVIDIA H200"
    body["engine_installs"] = INSTALLS[:1]
    sql = _statements(client, body, credential)
    # The known node's row is locked first, then only what changed is written.
    assert sql[2].startswith("SELECT ") and sql[2].endswith("FOR UPDATE")
    # One GPU changed, two gone; the fabrics and the installs replaced.
    assert sum(s.startswith('UPDATE "inventory_gpu"') for s in sql) == 1
    assert sum(s.startswith('DELETE FROM "inventory_gpu"') for s in sql) == 1
    assert sorted(GPU.objects.filter(node_id="node-a").values_list("index", flat=True)) == [0, 1, 2, 3, 4, 5]
    assert GPU.objects.get(node_id="node-a", index=0).name == "NVIDIA H200"
    assert list(EngineInstall.objects.filter(node_id="node-a").values_list("engine", flat=True)) == ["vllm"]
    assert FabricAttachment.objects.filter(node_id="node-a").count() == 1
    assert Node.objects.get(id="node-a").state == "ready"
    assert list(NodeEvent.objects.filter(node_id="node-a").order_by("id").values_list("message", flat=True)) == [
        "node joined",
        "credential issued (bootstrap token)",
        "agent re-registered",
    ]


def test_a_join_tokens_use_is_counted_last_so_its_row_is_locked_only_for_the_commit(client):
    # Every node of a rack joins with the one token: counting its use first held the token's row
    # locked through each registration's writes, and the rack's registrations queued on it.
    t0 = timezone.now()
    token, secret = credentials.create_join_token(
        name="rack 7", expires_at=t0 + dt.timedelta(hours=1), max_uses=2, now=t0
    )
    sql = _statements(client, register_payload("node-a", gpus=8), secret)
    table = JoinToken._meta.db_table
    counted = [i for i, s in enumerate(sql) if s.startswith(f'UPDATE "{table}"')]
    inserted = [i for i, s in enumerate(sql) if s.startswith("WITH")]
    assert len(counted) == 1 and len(inserted) == 1
    # The count is the transaction's last statement: after it only the savepoint's release.
    assert counted[0] > inserted[0]
    assert sql[counted[0] + 1 :] == [s for s in sql[counted[0] + 1 :] if s.startswith("RELEASE SAVEPOINT")]
    token.refresh_from_db()
    assert token.uses == 1
    assert Node.objects.filter(id="node-a").exists()
