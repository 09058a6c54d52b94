"""The API document describes every view, with no warning or error from its generator
(a view it cannot guess or two components that collide fail here), and it tells the
truth about the actions: each declares its own request and answers, and what the
actions really answer validates against what the document declares."""

from __future__ import annotations

import json

import jsonschema
import pytest
import yaml
from django.core.management import call_command
from django.utils import timezone
from drf_spectacular.drainage import GENERATOR_STATS, reset_generator_stats
from drf_spectacular.generators import SchemaGenerator
from drf_spectacular.renderers import OpenApiJsonRenderer
from rest_framework.test import APIClient

from llmgw.api_urls import router
from placement.models import Deployment, EngineProfile, PlacementEvent
from tests.factories import make_node
from tests.inventory.cockpit_fixtures import replica_on

V1 = "/api/v1"

# Every action and endpoint beside the plain CRUD of the viewsets: (method, path) ->
# (request component or None when it takes no body, {status: response component}).
ACTIONS = {
    ("post", "/api/v1/nodes/{id}/cordon/"): (
        "ActionInputRequest",
        {"200": "NodeActionOut", "400": "ActionInputErrors", "409": "StateConflictOut"},
    ),
    ("post", "/api/v1/nodes/{id}/uncordon/"): (
        "ActionInputRequest",
        {"200": "NodeActionOut", "400": "ActionInputErrors", "409": "StateConflictOut"},
    ),
    ("post", "/api/v1/nodes/{id}/drain/"): (
        "ActionInputRequest",
        {"200": "DrainOut", "400": "ActionInputErrors", "409": "StateConflictOut"},
    ),
    ("put", "/api/v1/nodes/{id}/labels/"): ("LabelsInputRequest", {"200": "LabelsOut", "400": "LabelsInputErrors"}),
    ("patch", "/api/v1/nodes/{id}/labels/"): (
        "PatchedLabelsInputRequest",
        {"200": "LabelsOut", "400": "LabelsInputErrors"},
    ),
    ("post", "/api/v1/deployments/{id}/scale/"): ("ScaleInRequest", {"200": "DeploymentOut", "400": "ScaleInErrors"}),
    ("post", "/api/v1/deployments/{id}/autoscale/"): (
        "AutoscaleInRequest",
        {"200": "DeploymentOut", "400": "AutoscaleInErrors"},
    ),
    ("get", "/api/v1/deployments/{id}/autoscale-samples/"): (None, {"200": "PaginatedAutoscaleSampleOutList"}),
    ("post", "/api/v1/deployments/{id}/pause/"): (None, {"200": "DeploymentOut"}),
    ("post", "/api/v1/deployments/{id}/resume/"): (None, {"200": "DeploymentOut"}),
    ("get", "/api/v1/replicas/{id}/events/"): (None, {"200": "PaginatedEventOutList"}),
    ("post", "/api/v1/placement/dry-run/"): ("DryRunInRequest", {"200": "DryRunOut", "400": "DryRunInErrors"}),
    ("get", "/api/v1/nvlink/"): (None, {"200": "[Rack]"}),
    ("get", "/api/v1/doctor/"): (None, {"200": "DoctorReport"}),
    ("post", "/api/v1/gateway/keys/{id}/rotate/"): (None, {"200": "KeyCreatedOut", "409": "KeyConflictOut"}),
    ("post", "/api/v1/gateway/keys/{id}/revoke/"): (None, {"200": "KeyOut", "409": "KeyConflictOut"}),
    ("get", "/api/v1/gateway/usage/"): (None, {"200": "UsageOut", "400": "UsageInErrors"}),
}
REFUSALS = dict.fromkeys(("400", "401", "403", "409", "413", "415"), "Problem")
AGENT = {
    ("post", "/api/v1/agent/register"): ("RegisterRequest", {"200": "RegisterResponse", **REFUSALS}),
    ("post", "/api/v1/agent/heartbeat"): ("HeartbeatRequest", {"200": "HeartbeatResponse", **REFUSALS}),
    ("post", "/api/v1/agent/scans"): ("ScanUploadRequest", {"200": "ScanStored", **REFUSALS}),
    ("post", "/api/v1/agent/rotate"): ("RotateCredentialRequest", {"200": "RegisterResponse", **REFUSALS}),
}


@pytest.fixture(scope="module")
def doc() -> dict:
    """The document as /api/schema/ serves it (JSON, every lazy string rendered)."""
    return json.loads(OpenApiJsonRenderer().render(SchemaGenerator().get_schema(request=None, public=True)))


def _ref(schema: dict) -> str:
    if schema.get("type") == "array":
        return f"[{_ref(schema['items'])}]"
    return schema["$ref"].removeprefix("#/components/schemas/")


def declared(doc: dict, method: str, path: str) -> tuple[str | None, dict[str, str]]:
    """An operation's request component and its response component by status, as the document has them."""
    op = doc["paths"][path][method]
    body = op.get("requestBody")
    request = _ref(body["content"]["application/json"]["schema"]) if body else None
    responses = {code: _ref(r["content"]["application/json"]["schema"]) for code, r in op["responses"].items()}
    return request, responses


def test_the_api_document_is_complete_and_valid(tmp_path):
    out = tmp_path / "schema.yaml"
    reset_generator_stats()  # count this generation's findings alone
    call_command("spectacular", "--fail-on-warn", "--validate", "--file", str(out))
    assert not GENERATOR_STATS._warn_cache and not GENERATOR_STATS._error_cache
    # OpenAPI 3.1 says "may be null" with a type list; 3.0's `nullable` means nothing to it.
    assert "nullable" not in out.read_text()
    doc = yaml.safe_load(out.read_text())
    # One path per operation: the slash-less alias of the dry run is not documented twice.
    assert "/api/v1/placement/dry-run" not in doc["paths"]
    dry_run = doc["paths"]["/api/v1/placement/dry-run/"]["post"]
    assert dry_run["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/DryRunInRequest"
    }
    assert dry_run["responses"]["200"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/DryRunOut"
    }


@pytest.mark.parametrize(("method", "path"), [*ACTIONS, *AGENT])
def test_each_action_declares_its_own_request_and_answers(doc, method, path):
    request, answers = declared(doc, method, path)
    if (method, path) in AGENT:
        assert (request, answers) == AGENT[(method, path)]
        return
    # Operator operations also carry the refusals every one of them can answer (llmgw/schema.py).
    own = {code: name for code, name in answers.items() if name not in ("ErrorDetail", "FieldErrors")}
    assert (request, own) == ACTIONS[(method, path)]
    assert (answers["401"], answers["403"]) == ("ErrorDetail", "ErrorDetail")


def test_every_action_of_every_viewset_is_in_the_table():
    """A new @action fails here until its request and answers are declared and listed above."""
    found = set()
    for prefix, viewset, _ in router.registry:
        for act in viewset.get_extra_actions():
            path = f"{V1}/{prefix}/{{id}}/{act.url_path}/" if act.detail else f"{V1}/{prefix}/{act.url_path}/"
            found |= {(m, path) for m in act.mapping}
    assert found == {k for k in ACTIONS if "{id}" in k[1]}


def test_the_components_say_what_the_actions_hold(doc):
    props = {name: sorted(s.get("properties", {})) for name, s in doc["components"]["schemas"].items()}
    assert props["NodeActionOut"] == ["node"]
    assert props["DrainOut"] == ["node", "replicas_to_move"]
    assert props["AffectedReplica"] == ["deployment", "replica_id", "replica_state", "shards"]
    assert props["LabelsOut"] == ["agent_labels", "effective_labels", "operator_labels"]
    assert props["ScaleInRequest"] == ["replicas"]
    assert doc["components"]["schemas"]["ScaleInRequest"]["required"] == ["replicas"]
    assert props["ActionInputRequest"] == ["reason"]
    assert props["StateConflictOut"] == ["state"]
    assert props["DryRunInRequest"] == ["deployment", "explain", "node_selector", "policy", "profile", "replicas"]
    explain = doc["components"]["schemas"]["DryRunInRequest"]["properties"]["explain"]
    assert explain["allOf"] == [{"$ref": "#/components/schemas/ExplainEnum"}] and explain["default"] == "summary"
    assert doc["components"]["schemas"]["ExplainEnum"]["enum"] == ["summary", "all"]
    assert props["PlanOut"] == [
        "env",
        "fabric",
        "fabric_name",
        "fits",
        "nvlink_domain",
        "ok",
        "reason",
        "reasons",
        "shards",
        "summary",
    ]
    assert props["ReasonCountOut"] == ["examples", "nodes", "reason"]


def _check(doc: dict, method: str, path: str, response) -> None:
    """The response's body validates against the component the document declares for its status."""
    _, responses = declared(doc, method, path)
    status = str(response.status_code)
    assert status in responses, f"{method} {path} answered {status}, which the document does not declare"
    name = responses[status]
    schema = {"$ref": f"#/components/schemas/{name}", "components": doc["components"]}
    jsonschema.validate(response.json(), schema, cls=jsonschema.Draft202012Validator)


@pytest.mark.django_db
def test_the_actions_answer_what_the_document_declares(doc, operator, now):
    c = APIClient()
    c.force_authenticate(operator)
    # Heard from just now: uncordon refuses a node whose agent is silent on the real clock.
    make_node("node-a", now=timezone.now(), labels={"rack": "r1"})
    make_node("node-b", now=timezone.now())
    replica = replica_on("node-a", now=now)
    nodes = f"{V1}/nodes/{{id}}"

    r = c.post(f"{V1}/nodes/node-b/cordon/", {"reason": "bios"}, format="json")
    assert r.status_code == 200 and r.json()["node"]["state"] == "cordoned"
    _check(doc, "post", f"{nodes}/cordon/", r)
    r = c.post(f"{V1}/nodes/node-b/uncordon/", {}, format="json")
    assert r.status_code == 200 and set(r.json()) == {"node"}
    _check(doc, "post", f"{nodes}/uncordon/", r)
    r = c.post(f"{V1}/nodes/node-a/drain/", {"reason": "swap a card"}, format="json")
    assert r.status_code == 200
    assert [m["replica_id"] for m in r.json()["replicas_to_move"]] == [str(replica.id)]
    _check(doc, "post", f"{nodes}/drain/", r)
    r = c.post(f"{V1}/nodes/node-b/uncordon/", {}, format="json")
    assert r.status_code == 409
    _check(doc, "post", f"{nodes}/uncordon/", r)
    r = c.post(f"{V1}/nodes/node-b/cordon/", {"reason": "x" * 501}, format="json")
    assert r.status_code == 400
    _check(doc, "post", f"{nodes}/cordon/", r)

    r = c.put(f"{V1}/nodes/node-b/labels/", {"labels": {"rack": "r9"}}, format="json")
    assert r.status_code == 200 and r.json()["operator_labels"] == {"rack": "r9"}
    _check(doc, "put", f"{nodes}/labels/", r)
    r = c.patch(f"{V1}/nodes/node-b/labels/", {"labels": {"rack": None}}, format="json")
    assert r.status_code == 200 and r.json()["operator_labels"] == {}
    _check(doc, "patch", f"{nodes}/labels/", r)
    r = c.put(f"{V1}/nodes/node-b/labels/", {"labels": {"rack": None}}, format="json")
    assert r.status_code == 400
    _check(doc, "put", f"{nodes}/labels/", r)

    dep = Deployment.objects.create(
        name="chat", served_model="chat", profile=EngineProfile.objects.create(name="echo-4", engine="echo")
    )
    deps = f"{V1}/deployments/{{id}}"
    r = c.post(f"{V1}/deployments/{dep.id}/scale/", {"replicas": 3}, format="json")
    assert r.status_code == 200 and r.json()["replicas"] == 3
    _check(doc, "post", f"{deps}/scale/", r)
    r = c.post(f"{V1}/deployments/{dep.id}/scale/", {"replicas": -1}, format="json")
    assert r.status_code == 400
    _check(doc, "post", f"{deps}/scale/", r)
    for name, paused in (("pause", True), ("resume", False)):
        r = c.post(f"{V1}/deployments/{dep.id}/{name}/")
        assert r.status_code == 200 and r.json()["paused"] is paused
        _check(doc, "post", f"{deps}/{name}/", r)

    PlacementEvent.objects.create(replica=replica, deployment=replica.deployment, kind="created", at=now)
    r = c.get(f"{V1}/replicas/{replica.id}/events/")
    assert r.status_code == 200 and r.json()["count"] == 1
    _check(doc, "get", f"{V1}/replicas/{{id}}/events/", r)
