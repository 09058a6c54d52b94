"""The API's pagination: DRF's limit/offset, described truly in an OpenAPI 3.1 document."""

from __future__ import annotations

from typing import Any

from rest_framework.pagination import LimitOffsetPagination as DRFLimitOffsetPagination


class LimitOffsetPagination(DRFLimitOffsetPagination):
    """DRF's limit/offset pagination, whose page schema says `next` and `previous` may be null.

    DRF describes them with OpenAPI 3.0's `nullable`, which a 3.1 document
    (this one) does not know: every list then declared a string where the
    first and last pages answer null, and a generated client or a schema
    checker refused the real answer.
    """

    def get_paginated_response_schema(self, schema: dict[str, Any]) -> dict[str, Any]:
        """The page's schema, with 3.1's ["string", "null"] for the links."""
        out = super().get_paginated_response_schema(schema)
        for link in ("next", "previous"):
            prop = out["properties"][link]
            prop.pop("nullable", None)
            prop["type"] = ["string", "null"]
        return out
