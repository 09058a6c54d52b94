"""The planner hands out no shard port a node reports listening, nor one a live shard holds."""

from __future__ import annotations

import pytest

from inventory import changes, telemetry
from placement.models import Deployment, EngineProfile, Shard
from placement.reconciler import reconcile
from tests.factories import make_node

pytestmark = pytest.mark.django_db


def test_reported_listening_ports_are_never_handed_out(now):
    make_node("a", now=now, mgmt_addr="10.0.0.1")
    make_node("b", now=now, mgmt_addr="10.0.0.2")
    # What a's agent last reported listening (its status in the cache); b reports nothing (an older agent).
    telemetry.put("a", {"listening_ports": [18000, 18002, "18003", True]})
    changes.mark(["a"])
    prof = EngineProfile.objects.create(name="echo-1", engine="echo", gpus_per_node=1)
    Deployment.objects.create(name="chat", served_model="chat", profile=prof, replicas=4, node_selector={})
    reconcile(now=now)
    ports = sorted(Shard.objects.values_list("node_id", "http_port"))
    # Binpack fills a first: 18000 and 18002 listen there; the malformed entries constrain nothing.
    assert ports == [("a", 18001), ("a", 18003), ("a", 18004), ("a", 18005)]


def test_nodes_at_one_address_share_what_listens_there(now):
    # Simulated nodes on one host: a port listening there is taken for every node at that address.
    make_node("a", now=now, mgmt_addr="127.0.0.1", gpus=1)
    make_node("b", now=now, mgmt_addr="127.0.0.1", gpus=1)
    telemetry.put("a", {"listening_ports": [18000, 18001]})
    changes.mark(["a"])
    prof = EngineProfile.objects.create(name="echo-1", engine="echo", gpus_per_node=1)
    Deployment.objects.create(name="chat", served_model="chat", profile=prof, replicas=2)
    reconcile(now=now)
    assert sorted(Shard.objects.values_list("node_id", "http_port")) == [("a", 18002), ("b", 18003)]
