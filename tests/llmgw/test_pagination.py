"""llmgw/pagination.py: a page's links may be null, in OpenAPI 3.1's words."""

from __future__ import annotations

from llmgw.pagination import LimitOffsetPagination


def test_the_page_links_are_a_string_or_null_and_nothing_says_nullable():
    page = LimitOffsetPagination().get_paginated_response_schema({"type": "array", "items": {"type": "integer"}})
    assert page["required"] == ["count", "results"]
    assert page["properties"]["results"] == {"type": "array", "items": {"type": "integer"}}
    for link in ("next", "previous"):
        assert page["properties"][link]["type"] == ["string", "null"]
        assert page["properties"][link]["format"] == "uri"
        assert "nullable" not in page["properties"][link]
