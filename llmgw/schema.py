"""The OpenAPI document's refusals: every operator operation declares the errors it can answer.

drf-spectacular documents an operation's success and leaves out DRF's own
refusals, so a client generated from the document, and the fuzz test that
checks every answer against it, met answers the document denied: 401 without
credentials, 403 without the permission, 404 for an id that is not there,
400 for a bad body or filter, 409 for a delete that is refused. They are
added here, once, with the bodies DRF sends.
"""

from __future__ import annotations

from typing import Any

from rest_framework import serializers

DETAIL = "ErrorDetail"
FIELDS = "FieldErrors"
SCHEMAS: dict[str, dict[str, Any]] = {
    DETAIL: {
        "type": "object",
        "description": "A refusal: what was refused, in words.",
        "properties": {"detail": {"type": "string"}},
        "required": ["detail"],
    },
    FIELDS: {
        "type": "object",
        "description": "Bad input: each field named, with its problems (or `detail` for a body that is not JSON).",
        "additionalProperties": True,
    },
}
WRITES = ("post", "put", "patch")
METHODS = ("get", "post", "put", "patch", "delete")
# Deletes refused while something still uses the row (placement/api.py).
CONFLICTS = ("/api/v1/profiles/{id}/", "/api/v1/deployments/{id}/")


def _answer(name: str, description: str) -> dict[str, Any]:
    return {
        "description": description,
        "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{name}"}}},
    }


def declare_refusals(result: dict[str, Any], generator: Any, request: Any, public: bool) -> dict[str, Any]:
    """drf-spectacular postprocessing hook: add the refusals each operator operation can answer.

    The agent endpoints (/api/v1/agent/) declare their own (agents/api.py)
    and are left as they are; a status an operation already declares is kept.
    """
    result.setdefault("components", {}).setdefault("schemas", {}).update(SCHEMAS)
    for path, item in result.get("paths", {}).items():
        if not path.startswith("/api/v1/") or path.startswith("/api/v1/agent/"):
            continue
        for method in METHODS:
            op = item.get(method)
            if op is None:
                continue
            responses = op.setdefault("responses", {})
            add = {
                "401": _answer(DETAIL, "No credentials, or invalid ones (an operator token or a session)."),
                "403": _answer(DETAIL, "The credentials lack the permission this operation needs."),
            }
            if method in WRITES or any(p.get("in") == "query" for p in op.get("parameters", [])):
                add["400"] = _answer(FIELDS, "A field, filter or body is malformed or out of range: each is named.")
            if method in WRITES:
                add["415"] = _answer(DETAIL, "The body is not application/json.")
            if "{" in path:
                add["404"] = _answer(DETAIL, "Nothing has that id.")
            if method == "delete" and path in CONFLICTS:
                add["409"] = _answer(FIELDS, "Still in use: the answer names what uses it and what to do.")
            for status, answer in add.items():
                responses.setdefault(status, answer)
    return result


def field_errors(
    name: str, doc: str, fields: tuple[str, ...], **special: serializers.Field
) -> type[serializers.Serializer]:
    """A 400 body's serializer for the document: each of `fields` a list of problems, present only when it has one.

    `special` gives a field another shape (a JSON field's problems can be nested). The
    class is named `name`, so the document's component keeps that name.
    """
    attrs: dict[str, Any] = {"__doc__": doc, "__module__": __name__}
    for field in fields:
        attrs[field] = special.get(field) or serializers.ListField(child=serializers.CharField(), required=False)
    return type(name, (serializers.Serializer,), attrs)
