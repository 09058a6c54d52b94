"""Each engine walked through every layer that names it, so the layers cannot disagree again.

Discovery (the agent), registration and placement (the control plane), the
agent's answer to an install request, and the start command must all speak of
one engine by one name: discovery once reported `llama-server` while profiles
said `llamacpp`, placement asked every real node to install what it had, the
agent answered "unsupported ... found: none", and no llama.cpp deployment ran.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import llmgw_wire as wire
from inventory import outbox
from inventory.models import Node
from llmgw_agent import engines as agent_engines
from llmgw_agent.commands import install_answer
from llmgw_agent.discovery import discover
from llmgw_wire import engines as wire_engines
from placement import snapshot_db
from placement.models import Deployment, EngineProfile
from placement.planner import ReplicaRequest, plan
from placement.reconciler import reconcile
from tests.factories import make_node

pytestmark = pytest.mark.django_db

PROFILES = Path(__file__).resolve().parents[1] / "llmgw_sim" / "profiles"
# A recorded machine that has each engine installed (its probe's output recorded on the engine's own stream).
MACHINE = {"vllm": "hgx-h100", "sglang": "hgx-h100", "llamacpp": "cpu-only"}
MODEL = {"vllm": "/models/llama-3-8b", "sglang": "/models/llama-3-8b", "llamacpp": "/models/tiny.gguf"}
PROBED = [e for e in wire_engines.ENGINES.values() if not e.builtin]


def test_every_probed_engine_has_a_recorded_machine():
    assert sorted(MACHINE) == sorted(e.name for e in PROBED)


@pytest.mark.parametrize("engine", PROBED, ids=lambda e: e.name)
def test_an_engine_is_one_name_from_discovery_to_the_start_command(engine, now):
    found = discover(root=PROFILES / MACHINE[engine.name], model_dirs=[])
    version = found.engine_versions[engine.name]
    assert wire_engines.get(engine.name).version(version).text == version

    # Registration keeps the name discovery used; placement finds the engine installed there.
    make_node("has", now=now, labels={"has": "1"}, engines_probed=True, engine_versions=found.engine_versions)
    make_node("lacks", now=now, engines_probed=True, engine_versions={})
    assert engine.name in Node.objects.get(id="has").engine_versions
    snap = snapshot_db.build()
    for alias in (engine.name, *engine.aliases):
        planned = plan(ReplicaRequest(engine=alias, gpus_per_node=1, selector={"has": "1"}), snap)
        assert [(s.node_id, s.install_engine) for s in planned.shards] == [("has", False)]

        # The agent that found it answers an install request under any of its names: ready.
        answer = install_answer(wire.InstallEngine(engine=alias), found.engine_versions)
        assert (answer.engine, answer.state, answer.version) == (engine.name, "ready", version)

    # A deployment on the node that has it: no install asked, and the start command builds.
    Node.objects.filter(id="lacks").update(state="cordoned")
    prof = EngineProfile.objects.create(name="p", engine=engine.name, gpus_per_node=1, model_path=MODEL[engine.name])
    Deployment.objects.create(name="d", served_model="d", profile=prof, replicas=1)
    reconcile(now=now)
    sent = outbox.pending("has", now=now)
    assert [type(c).__name__ for c in sent] == ["StartShard"]
    launch = agent_engines.build(sent[0], version=version)
    assert launch.argv[0] == engine.probe.argv[0]


@pytest.mark.parametrize("engine", PROBED, ids=lambda e: e.name)
def test_a_node_without_the_engine_is_asked_under_the_canonical_name(engine, now):
    make_node("lacks", now=now, engines_probed=True, engine_versions={})
    prof = EngineProfile.objects.create(name="p", engine=engine.name, gpus_per_node=1, model_path=MODEL[engine.name])
    Deployment.objects.create(name="d", served_model="d", profile=prof, replicas=1)
    reconcile(now=now)
    installs = [c for c in outbox.pending("lacks", now=now) if isinstance(c, wire.InstallEngine)]
    assert [c.engine for c in installs] == [engine.name]
    answer = install_answer(installs[0], {})
    assert (answer.engine, answer.state) == (engine.name, "unsupported")


def test_an_older_agent_reporting_llama_server_is_read_as_llamacpp(now):
    # An agent from before the registry reports llama.cpp under its program's name.
    make_node("old", now=now, engines_probed=True, engine_versions={"llama-server": "b4589"})
    assert Node.objects.get(id="old").engine_versions == {"llamacpp": "b4589"}
    snap = snapshot_db.build()
    assert snap.nodes["old"].engines == frozenset({"llamacpp"})
    planned = plan(ReplicaRequest(engine="llamacpp", gpus_per_node=1), snap)
    assert [(s.node_id, s.install_engine) for s in planned.shards] == [("old", False)]
    # Its install answers, keyed by the old name, are read under the canonical one too.
    assert install_answer(wire.InstallEngine(engine="llamacpp"), {"llama-server": "b4589"}).state == "ready"


def test_the_install_answer_reads_versions_as_the_registry_does_and_says_what_to_install():
    # A profile asking for llama.cpp "4589" means the build discovery reports as "b4589".
    assert (
        install_answer(wire.InstallEngine(engine="llama.cpp", version="4589"), {"llamacpp": "b4589"}).state == "ready"
    )
    answer = install_answer(wire.InstallEngine(engine="llamacpp", version="b7000"), {"llamacpp": "b4589"})
    assert (answer.state, answer.detail) == (
        "unsupported",
        "this agent does not install engines; install llama.cpp b7000 on the node so that `llama-server --version` "
        "answers (found: b4589), then restart the agent",
    )
