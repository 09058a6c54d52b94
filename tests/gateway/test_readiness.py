"""The gateway's liveness and readiness: /healthz at once, /readyz once its table is loaded."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from gateway.dataplane.app import DataPlane


def asgi_get(app: DataPlane, path: str) -> tuple[int, dict]:
    """One GET through the data plane's ASGI callable, before its start-up (no table loaded)."""
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "GET", "path": path, "headers": [], "query_string": b""}
    asyncio.run(app(scope, receive, send))
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return sent[0]["status"], json.loads(body)


def test_a_gateway_is_live_at_once_and_ready_only_once_its_table_is_loaded():
    app = DataPlane()
    assert asgi_get(app, "/healthz") == (200, {"status": "ok", "models": 0})
    assert asgi_get(app, "/readyz") == (503, {"status": "unavailable", "failed": ["routes"]})
    app.loaded.set()
    assert asgi_get(app, "/readyz") == (200, {"status": "ok", "models": 0})


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_running_gateway_is_ready(gateway):
    assert httpx.get(f"{gateway.url}/readyz", timeout=5).json() == {"status": "ok", "models": 0}
    assert httpx.get(f"{gateway.url}/healthz", timeout=5).status_code == 200
