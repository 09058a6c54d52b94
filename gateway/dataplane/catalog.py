"""The models a key may use, as OpenAI's SDKs list and retrieve them (GET /v1/models, GET /v1/models/{id})."""

from __future__ import annotations

from gateway.dataplane.http import Send, error_body, send_json, send_raw
from gateway.table import KeyEntry, ModelRoute


def model_object(route: ModelRoute) -> dict:
    """A model in OpenAI's shape, with its replicas ready and wanted."""
    return {
        "id": route.name,
        "object": "model",
        "created": 0,
        "owned_by": "llmgw",
        "ready_replicas": len(route.backends),
        "replicas": route.desired,
    }


class Catalog:
    """The data plane's model listing; its routing table is the DataPlane's."""

    routes: dict[str, ModelRoute]

    async def _models(self, send: Send, key: KeyEntry) -> None:
        data = [model_object(route) for name, route in sorted(self.routes.items()) if key.allows(name)]
        await send_json(send, 200, {"object": "list", "data": data})

    async def _model(self, send: Send, key: KeyEntry, name: str) -> None:
        route = self.routes.get(name)
        if route is None or not key.allows(name):
            # A model the key may not use is not told apart from one that does not exist.
            body = error_body(
                404, f"the model {name!r} does not exist", "invalid_request_error", "model_not_found", "model"
            )
            await send_raw(send, 404, body)
            return
        await send_json(send, 200, model_object(route))
