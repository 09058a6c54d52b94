"""The data plane's shared answers: request ids and engines' errors in OpenAI's shape."""

from __future__ import annotations

import json

import pytest

from gateway.dataplane.http import engine_error, request_id


def _err(raw: bytes) -> dict:
    body = json.loads(raw)
    assert set(body) == {"error"}
    return body["error"]


@pytest.mark.parametrize(
    ("status", "raw", "expected"),
    [
        # vLLM's current shape: a numeric code.
        (
            400,
            b'{"error": {"message": "messages: too short", "type": "BadRequestError", "param": null, "code": 400}}',
            {"message": "messages: too short", "type": "BadRequestError", "param": None, "code": "invalid_request"},
        ),
        # vLLM's older flat shape.
        (
            404,
            b'{"object": "error", "message": "The model `x` does not exist.", "type": "NotFoundError", '
            b'"param": "model", "code": 404}',
            dict(message="The model `x` does not exist.", type="NotFoundError", param="model", code="not_found"),
        ),
        # FastAPI's own, and a string code kept as it is.
        (
            422,
            b'{"detail": "Unprocessable"}',
            {"message": "Unprocessable", "type": "invalid_request_error", "param": None, "code": "invalid_request"},
        ),
        (
            400,
            b'{"error": {"message": "too long", "type": "invalid_request_error", "code": "context_length_exceeded"}}',
            {"message": "too long", "type": "invalid_request_error", "param": None, "code": "context_length_exceeded"},
        ),
        # Not JSON, or a program's insides: words instead.
        (
            418,
            b"<html>teapot</html>",
            {
                "message": "the engine refused the request (HTTP 418)",
                "type": "invalid_request_error",
                "param": None,
                "code": "engine_error",
            },
        ),
        (
            400,
            b'{"error": {"message": "ValueError(\'bad\') at 10.0.0.5:8000", "code": 400}}',
            {
                "message": "the engine refused the request (HTTP 400)",
                "type": "invalid_request_error",
                "param": None,
                "code": "invalid_request",
            },
        ),
        (
            400,
            b'{"error": {"message": "cannot reach the tokenizer at 10.0.0.5:8000", "code": "tokenizer"}}',
            {
                "message": "the engine refused the request (HTTP 400)",
                "type": "invalid_request_error",
                "param": None,
                "code": "tokenizer",
            },
        ),
    ],
)
def test_engine_errors_in_openais_shape_with_a_string_code(status, raw, expected):
    assert _err(engine_error(status, raw)) == expected


def test_a_sane_client_request_id_is_echoed_else_one_is_made():
    assert request_id({"headers": [(b"x-request-id", b"req-42.a:b_c")]}) == b"req-42.a:b_c"
    for bad in (b"two words", b"a\r\nx-evil: 1", b"", b"x" * 129):
        made = request_id({"headers": [(b"x-request-id", bad)]})
        assert made != bad and len(made) == 32 and made.isalnum()
    assert request_id({"headers": []}) != request_id({"headers": []})
