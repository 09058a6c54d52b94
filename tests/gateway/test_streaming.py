"""Reading an answer's usage on its way to the client: chat and completion streams, the Responses API's."""

from __future__ import annotations

import json

from gateway.dataplane.streaming import Outcome, Relay


def _scan(lines: list[dict | str]) -> Outcome:
    out = Outcome()
    data = b"".join(
        b"data: " + (json.dumps(x).encode() if isinstance(x, dict) else x.encode()) + b"\n\n" for x in lines
    )
    rest = b""
    for i in range(0, len(data), 5):  # in small reads, lines split across them
        rest = Relay()._scan_sse(rest + data[i : i + 5], out)
    return out


def test_a_chat_streams_usage_chunk_is_read():
    out = _scan(
        [
            {"choices": [{"index": 0, "delta": {"content": "a"}}]},
            {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9}},
            "[DONE]",
        ]
    )
    assert (out.prompt_tokens, out.completion_tokens) == (7, 2)


def test_the_responses_apis_usage_is_read_from_its_completed_event():
    usage = {"input_tokens": 5, "output_tokens": 3, "total_tokens": 8}
    out = _scan(
        [
            {"type": "response.created", "response": {"id": "resp_1", "usage": None}},
            {"type": "response.output_text.delta", "delta": "a"},
            {"type": "response.completed", "response": {"id": "resp_1", "usage": usage}},
        ]
    )
    assert (out.prompt_tokens, out.completion_tokens) == (5, 3)
