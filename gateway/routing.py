"""Which replica takes a request: bounded-load consistent hashing over the conversation's first block.

Requests that start alike (the same system prompt and first user turn: every
turn of one conversation, or one-shot prompts sharing a long preamble) hash
to the same replica, whose KV cache most likely holds that prefix. Replicas
are ranked for a key by rendezvous hashing, so a replica joining or leaving
moves only its own share of keys. The first replica in that order whose load
(with this request) stays within `balance` times the mean plus `slack`
requests takes it: a replica markedly busier than the others is passed over
(a few requests more cost less than a cold cache, since engines batch), and the key spills to its next choice
in a stable order, where the spill's prefix will in turn be cached.
Requests with nothing to hash go to the least-loaded replica.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

from gateway.table import Backend

# Characters of the conversation's start that make its key: enough to tell
# conversations apart, bounded so hashing a long prompt costs little.
PREFIX_CHARS = 4096
DEFAULT_BALANCE = 1.25
DEFAULT_SLACK = 4


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def prefix_key(body: Mapping[str, Any]) -> bytes | None:
    """The routing key of a request body: its system messages and first user turn, or its prompt's start."""
    messages = body.get("messages")
    if isinstance(messages, list) and messages:
        parts: list[str] = []
        for m in messages:
            if not isinstance(m, dict):
                continue
            parts.append(f"{m.get('role')}:{_text(m.get('content'))}\n")
            if m.get("role") == "user":
                break
        text = "".join(parts)
    else:
        prompt = body.get("prompt", body.get("input"))
        if isinstance(prompt, list):
            prompt = prompt[0] if prompt else ""
        text = prompt if isinstance(prompt, str) else ""
    if not text:
        return None
    return text[:PREFIX_CHARS].encode("utf-8", "surrogatepass")


def _score(key: bytes, backend_id: str) -> bytes:
    return hashlib.blake2b(key + backend_id.encode(), digest_size=8).digest()


def choose(
    backends: Sequence[Backend],
    *,
    key: bytes | None,
    load: Mapping[str, int],
    exclude: frozenset[str] | set[str] = frozenset(),
    balance: float = DEFAULT_BALANCE,
    slack: int = DEFAULT_SLACK,
) -> Backend | None:
    """The replica for a request with routing key `key`, given each replica's current load; None if none is left."""
    candidates = [b for b in backends if b.id not in exclude]
    if not candidates:
        return None
    if key is None:
        return min(candidates, key=lambda b: (load.get(b.id, 0), b.id))
    total = sum(load.get(b.id, 0) for b in candidates)
    cap = balance * (total + 1) / len(candidates) + slack
    ranked = sorted(candidates, key=lambda b: _score(key, b.id), reverse=True)
    for b in ranked:
        if load.get(b.id, 0) + 1 <= cap:
            return b
    return ranked[0]


def round_robin(
    backends: Sequence[Backend], turn: int, *, exclude: frozenset[str] | set[str] = frozenset()
) -> Backend | None:
    """The `turn`-th replica in rotation, skipping excluded ones (the baseline the benchmark compares with)."""
    candidates = [b for b in backends if b.id not in exclude]
    return candidates[turn % len(candidates)] if candidates else None
