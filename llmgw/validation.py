"""One validation layer for what reaches the database from outside.

PostgreSQL stores no NUL character (in text or in jsonb), and psycopg cannot
encode a lone UTF-16 surrogate; either turned a request into a 500 after
half its checks had passed. JSON nested thousands deep exhausts Python's
recursion before any serializer sees it. A page size or offset past the
bigint range fails in the database. Each is bad input, so each is refused
here as a 400 naming the field, before anything is parsed deeper or written.
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Iterator
from typing import Any

from django.conf import settings
from django.http import HttpResponse, JsonResponse
from rest_framework.exceptions import ParseError, ValidationError
from rest_framework.parsers import JSONParser
from rest_framework.settings import api_settings

from llmgw.pagination import LimitOffsetPagination

# Deeper than any body of this API needs (a label map is two levels deep).
MAX_JSON_DEPTH = 32
# The most rows one page of a list answers.
MAX_PAGE = 1000
# An offset past this is past any table's end; PostgreSQL refuses bigint overflow.
MAX_OFFSET = 2**62
MAX_ERRORS = 50

_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_BRACKETS = re.compile(rb"[\[\]{}]")


def json_depth(body: bytes) -> int:
    """How deeply a JSON text nests arrays and objects, measured without parsing it."""
    depth = deepest = 0
    for m in _BRACKETS.finditer(_STRING.sub(b'""', body)):
        if m.group() in (b"[", b"{"):
            depth += 1
            deepest = max(deepest, depth)
        else:
            depth -= 1
    return deepest


def unstorable(text: str) -> str:
    """Why PostgreSQL cannot store a string ("" when it can): a NUL, or a lone surrogate."""
    if "\x00" in text:
        return "Null characters are not allowed."
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return "Surrogate characters are not allowed."
    return ""


def unstorable_fields(value: Any, prefix: str = "") -> Iterator[tuple[str, str]]:
    """Each (field path, problem) of a parsed JSON value holding a string PostgreSQL cannot store.

    Object keys count too: they become jsonb keys, or the names of labels.
    """
    if isinstance(value, str):
        why = unstorable(value)
        if why:
            yield prefix or "(body)", why
    elif isinstance(value, dict):
        for k, v in value.items():
            path = f"{prefix}.{k}" if prefix else str(k)
            why = unstorable(k) if isinstance(k, str) else ""
            if why:
                yield (prefix or "(body)"), f"a key: {why}"
            else:
                yield from unstorable_fields(v, path)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from unstorable_fields(v, f"{prefix}.{i}" if prefix else str(i))


# A NUL arrives in a JSON text only escaped (a raw control character is invalid JSON).
_NUL_ESCAPE = re.compile(rb"\\u0000")


def nul_problems(body: bytes) -> list[dict]:
    """For a JSON body already accepted by its schema: each field holding a NUL, as {"field", "problem"}.

    The agent endpoints' bodies arrive every few seconds; one byte search
    decides, and only a body with the escape in it is walked.
    """
    if not _NUL_ESCAPE.search(body):
        return []
    try:
        parsed = json.loads(body)
    except ValueError:
        return []
    out = []
    for path, why in unstorable_fields(parsed):
        out.append({"field": path, "problem": why})
        if len(out) >= MAX_ERRORS:
            break
    return out


class BoundedJSONParser(JSONParser):
    """DRF's JSON parser, refusing deep nesting before parsing and unstorable strings after (400 naming the field)."""

    def parse(self, stream, media_type=None, parser_context=None):
        """Parse a JSON body, bounded in depth and holding only strings PostgreSQL can store."""
        parser_context = parser_context or {}
        encoding = parser_context.get("encoding", settings.DEFAULT_CHARSET)
        raw = stream.read() if stream is not None else b""
        if json_depth(raw) > MAX_JSON_DEPTH:
            raise ParseError(f"JSON parse error - nested deeper than {MAX_JSON_DEPTH} levels")
        try:
            text = codecs.decode(raw, encoding)
            data = json.loads(text, parse_constant=_strict) if api_settings.STRICT_JSON else json.loads(text)
        except ValueError as exc:
            raise ParseError(f"JSON parse error - {exc}") from None
        errors: dict[str, list[str]] = {}
        for path, why in unstorable_fields(data):
            errors.setdefault(path, []).append(why)
            if len(errors) >= MAX_ERRORS:
                break
        if errors:
            raise ValidationError(errors)
        return data


def _strict(name: str) -> None:
    raise ValueError(f"{name} is not valid JSON")


class BoundedPagination(LimitOffsetPagination):
    """Limit/offset pages with a largest page, and an offset the database can take."""

    max_limit = MAX_PAGE

    def get_offset(self, request) -> int:
        """The offset asked for, no further than MAX_OFFSET (a page past the end is empty either way)."""
        return min(super().get_offset(request), MAX_OFFSET)


class UnstorableRequestMiddleware:
    """Refuse a URL holding a character PostgreSQL cannot store, before any view looks it up.

    A NUL in a filter (`?name=%00`) or an id (`/api/v1/nodes/%00/`) reached a
    query and failed in the database driver: a 500. No row can have such an
    id, so the path is a 404; a query parameter is a 400 naming it.
    """

    def __init__(self, get_response) -> None:
        self.get_response = get_response

    def __call__(self, request):
        """Answer 404 or 400 for an unstorable path or query; otherwise pass the request on."""
        if unstorable(request.path_info):
            return self._refuse(request, 404, {"detail": "Not found."})
        errors: dict[str, list[str]] = {}
        for key, values in request.GET.lists():
            why = unstorable(key) or next((w for v in values if (w := unstorable(v))), "")
            if why:
                errors[key if not unstorable(key) else "(query)"] = [why]
        if errors:
            return self._refuse(request, 400, errors)
        return self.get_response(request)

    @staticmethod
    def _refuse(request, status: int, body: dict) -> HttpResponse:
        if request.path_info.startswith("/api/"):
            return JsonResponse(body, status=status)
        return HttpResponse(status=status)
