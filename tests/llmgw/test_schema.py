"""The OpenAPI document declares the refusals each operator operation answers with."""

from __future__ import annotations

from drf_spectacular.generators import SchemaGenerator


def test_every_operator_operation_declares_its_refusals():
    doc = SchemaGenerator().get_schema(request=None, public=True)
    checked = 0
    for path, item in doc["paths"].items():
        if not path.startswith("/api/v1/") or path.startswith("/api/v1/agent/"):
            continue
        for method, op in item.items():
            if method not in ("get", "post", "put", "patch", "delete"):
                continue
            checked += 1
            codes = set(op["responses"])
            assert {"401", "403"} <= codes, (method, path)
            if "{" in path:
                assert "404" in codes, (method, path)
            if method in ("post", "put", "patch"):
                assert {"400", "415"} <= codes, (method, path)
    assert checked >= 30
    assert doc["paths"]["/api/v1/deployments/{id}/"]["delete"]["responses"]["409"]["content"]["application/json"] == {
        "schema": {"$ref": "#/components/schemas/FieldErrors"}
    }
    # The agent endpoints keep their own declarations.
    assert "404" not in doc["paths"]["/api/v1/agent/heartbeat"]["post"]["responses"]
