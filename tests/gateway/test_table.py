"""The data plane's table: ready, unretired replicas per served model, and usable keys, in constant queries."""

from __future__ import annotations

import datetime as dt

import pytest
from django.utils import timezone

from gateway import keys, usage
from gateway.table import ModelRoute, load_keys, load_routes
from placement.models import Deployment, EngineProfile, Replica, ReplicaState, Shard
from tests.factories import make_node

pytestmark = pytest.mark.django_db


def _replica(dep, state, now, endpoint="", reason=""):
    return Replica.objects.create(
        deployment=dep, state=state, endpoint=endpoint, reason=reason, created_at=now, updated_at=now
    )


def test_only_ready_replicas_route_and_the_reason_when_none(now, django_assert_num_queries):
    prof = EngineProfile.objects.create(name="p", engine="vllm")
    dep = Deployment.objects.create(name="d1", served_model="llama", profile=prof, replicas=2)
    dep2 = Deployment.objects.create(name="d2", served_model="llama", profile=prof, replicas=1)
    empty = Deployment.objects.create(name="d3", served_model="big", profile=prof, replicas=2)
    ready = _replica(dep, ReplicaState.READY, now, "http://a:1")
    _replica(dep, ReplicaState.DRAINING, now, "http://b:1")
    _replica(dep, ReplicaState.DEGRADED, now, "http://c:1")
    _replica(dep2, ReplicaState.STARTING, now, "http://d:1")
    _replica(empty, ReplicaState.PENDING, now, reason="3 free GPUs, needs 4")
    _replica(empty, ReplicaState.PENDING, now + dt.timedelta(seconds=1), reason="later")
    node = make_node("n1", now=now, engine_versions={"vllm": "0.12.0"}, engines_probed=True)
    Shard.objects.create(replica=ready, node=node, rank=0, http_port=1, created_at=now, updated_at=now)
    with django_assert_num_queries(3):
        table = load_routes()
    assert set(table) == {"llama", "big"}
    llama = table["llama"]
    assert [(b.id, b.endpoint, b.engine, b.engine_version, b.deployment) for b in llama.backends] == [
        (str(ready.id), "http://a:1", "vllm", "0.12.0", "d1")
    ]
    assert llama.desired == 3
    assert table["big"].backends == ()
    assert table["big"].unavailable_reason() == "big: 0 of 2 replicas ready; pending: 3 free GPUs, needs 4"
    assert ModelRoute("m", (), 1, "").unavailable_reason() == "m: 0 of 1 replicas ready"


def test_keys_by_hash_without_revoked(operator, now, django_assert_num_queries):
    live, secret = keys.create_key(name="live", owner=operator, now=now, allowed_models=["a"], tpm_limit=9)
    gone, _ = keys.create_key(name="gone", owner=operator, now=now)
    keys.revoke(gone.id, now=now)
    with django_assert_num_queries(1):
        table = load_keys()
    assert list(table) == [keys.hash_secret(secret)]
    entry = table[keys.hash_secret(secret)]
    assert (entry.id, entry.name, entry.tpm_limit, entry.rpm_limit) == (live.id, "live", 9, 0)
    assert entry.allows("a") and not entry.allows("b")


def test_budgeted_keys_carry_their_recorded_spend(operator, django_assert_num_queries):
    today = timezone.now()
    plain, plain_secret = keys.create_key(name="plain", owner=operator, now=today - dt.timedelta(days=40))
    budgeted, secret = keys.create_key(
        name="budgeted", owner=operator, now=today - dt.timedelta(days=40), tokens_per_day=100, tokens_per_month=1000
    )
    acc = usage.Accumulator()
    acc.add(budgeted.id, "demo", today.timestamp(), prompt_tokens=7, completion_tokens=3)
    acc.add(plain.id, "demo", today.timestamp(), prompt_tokens=7)
    usage.write_batch(acc.take())
    # The keys, and the spend of those with a budget.
    with django_assert_num_queries(2):
        table = load_keys()
    entry = table[keys.hash_secret(secret)]
    assert (entry.tokens_per_day, entry.tokens_per_month) == (100, 1000)
    assert (entry.recorded, entry.recorded_on) == (usage.Spent(day=10, month=10), today.astimezone(dt.UTC).date())
    assert table[keys.hash_secret(plain_secret)].recorded == usage.Spent()
