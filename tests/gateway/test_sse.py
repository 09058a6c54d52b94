"""Taking the usage the client did not ask for out of a stream, whatever way its bytes arrive."""

from __future__ import annotations

import json

from gateway.dataplane.sse import UsageStripper

USAGE = {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4}


def _chunk(content: str | None, **extra) -> bytes:
    choices = [{"index": 0, "delta": {"content": content}}]
    return b"data: " + json.dumps({"id": "c", "choices": choices, **extra}).encode()


STREAM = b"\n\n".join(
    [
        _chunk("a"),
        _chunk(" b", usage=None),
        b"data: " + json.dumps({"id": "c", "choices": [], "usage": USAGE}).encode(),
        b"data: [DONE]",
        b"",
    ]
)
EXPECTED = b"\n\n".join([_chunk("a"), _chunk(" b"), b"data: [DONE]", b""])


def test_the_usage_chunk_and_usage_fields_are_taken_out():
    s = UsageStripper()
    assert s.feed(STREAM) + s.end() == EXPECTED


def test_any_split_of_the_bytes_gives_the_same_stream():
    for size in (1, 2, 3, 7, 64):
        s = UsageStripper()
        out = b"".join(s.feed(STREAM[i : i + size]) for i in range(0, len(STREAM), size)) + s.end()
        assert out == EXPECTED, size


def test_crlf_lines_and_a_last_line_without_its_newline():
    stream = STREAM.replace(b"\n", b"\r\n").rstrip(b"\r\n")
    s = UsageStripper()
    out = s.feed(stream) + s.end()
    assert out == EXPECTED.replace(b"\n", b"\r\n").rstrip(b"\r\n")


def test_text_that_only_mentions_usage_and_lines_that_are_not_json_pass_untouched():
    mention = b'data: {"choices": [{"index": 0, "text": "\\"usage\\" is a word"}]}\n\n'
    odd = b'data: {"usage": not json\n\n'
    s = UsageStripper()
    assert s.feed(mention + odd) == mention + odd


def test_the_usage_taken_out_is_kept_for_the_count():
    for size in (3, len(STREAM)):
        s = UsageStripper()
        for i in range(0, len(STREAM), size):
            s.feed(STREAM[i : i + size])
        s.end()
        assert s.usage == USAGE, size
