"""Which replica takes a request: the one holding the longest cached prefix of it, within a load bound.

Engines cache a prompt's KV in fixed-size blocks identified by everything up
to them (vLLM's automatic prefix caching, SGLang's radix tree), so a replica
helps a request exactly as far as it has seen the same start. The gateway
keeps, per replica, an approximate index of the prompt blocks it recently
sent there: the prompt rendered as text (each message's role and content),
split into BLOCK_BYTES-byte blocks, each named by a hash chained over every
block before it, so that only a shared start matches. The text is the
gateway's own, not the engine's tokens: a block boundary falls elsewhere than
the engine's, but a shared start is a shared start in both, which is all a
router needs, and it works on any engine (no tokenizer endpoint).

A request goes to the replica holding the longest prefix of it, unless that
replica's load (with this request) would exceed `balance` times the mean plus
`slack`; then to the next longest within the bound. So a conversation's later
turns go where its history is, and a new conversation sharing a system prompt
with earlier ones goes where that prompt already is. With nothing cached
anywhere it goes to the least-loaded replica, then, when the conversation's
start (its system messages and first user turn) fills a block, to the one
holding the fewest blocks (as vLLM's router sends a prompt it matches
nowhere to its smallest tree), ties broken by rendezvous hashing over that
start, so that a conversation too short to fill a block still keeps to one
replica. Several gateway processes place a new prompt each by its own
index, so alike only while their indexes are.

The index is bounded: each replica's holds at most `capacity` blocks and
forgets the least recently sent first, as the engine's LRU evicts, and a
prompt's blocks are refreshed tail first so that its start is the last to go
(vLLM frees a request's blocks in reverse for the same reason). It is kept per
process, not shared: a lookup on every request in Redis would cost a round
trip and the CPU the data plane is built to save, and each process learns from
its own traffic; several processes each place a new prompt once (on the same
replica while loads are even), and see one another's load through the engines'
own figures.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from gateway.table import Backend

# Bytes of the rendered prompt in one block: about 32 tokens of English (an
# engine's blocks are 16), so a few-hundred-word system prompt makes a dozen.
BLOCK_BYTES = 128
# Blocks hashed per request at most (128 KiB of prompt): beyond that a longer
# shared start changes no routing decision worth its hashing.
MAX_BLOCKS = 1024
# Blocks remembered per replica by default (512 KiB of prompt text, about
# 128,000 tokens: a small GPU's KV cache); about 120 bytes each in memory.
DEFAULT_CAPACITY = 4096
# Bytes of the conversation's start that break ties between replicas holding nothing of it.
START_BYTES = 1024
DEFAULT_BALANCE = 1.25
DEFAULT_SLACK = 4


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def rendered(body: Mapping[str, Any]) -> bytes:
    """The prompt of a request body as the engine caches it: every message's role and text, or the prompt."""
    messages = body.get("messages")
    if isinstance(messages, list) and messages:
        text = "".join(f"{m.get('role')}\n{_text(m.get('content'))}\n" for m in messages if isinstance(m, dict))
    else:
        prompt = body.get("prompt", body.get("input"))
        if isinstance(prompt, list):
            prompt = prompt[0] if prompt else ""
        text = prompt if isinstance(prompt, str) else ""
    return text.encode("utf-8", "surrogatepass")


def conversation_start(body: Mapping[str, Any]) -> bytes:
    """The start every turn of a conversation shares: its system messages and first user turn, or the prompt's."""
    messages = body.get("messages")
    if not (isinstance(messages, list) and messages):
        return rendered(body)[:START_BYTES]
    parts: list[str] = []
    for m in messages:
        if not isinstance(m, dict):
            continue
        parts.append(f"{m.get('role')}\n{_text(m.get('content'))}\n")
        if m.get("role") == "user":
            break
    return "".join(parts).encode("utf-8", "surrogatepass")[:START_BYTES]


def block_hashes(body: Mapping[str, Any]) -> tuple[int, ...]:
    """The chained hashes of the request's full blocks and its last partial one (empty if it has no prompt).

    Python's own hash: the index is this process's, so its hashes need agree with no
    other process, and it costs a tenth of a cryptographic one per block.
    """
    data = rendered(body)
    out: list[int] = []
    prev = 0
    for i in range(0, min(len(data), BLOCK_BYTES * MAX_BLOCKS), BLOCK_BYTES):
        prev = hash((prev, data[i : i + BLOCK_BYTES]))
        out.append(prev)
    return tuple(out)


class PrefixIndex:
    """Per replica, the blocks recently sent to it, least recently sent forgotten first beyond `capacity`."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self.capacity = max(1, capacity)
        self.replicas: dict[str, OrderedDict[int, None]] = {}

    def matched(self, replica: str, hashes: Sequence[int]) -> int:
        """How many of the request's leading blocks the replica holds.

        A binary search: a replica's blocks are nearly closed under prefixes (a
        prompt's blocks are sent together and its start is refreshed last, and
        a shared start by every prompt that shares it), so the longest held
        prefix is found in a few lookups instead of one per block.
        """
        blocks = self.replicas.get(replica)
        if not blocks:
            return 0
        lo, hi = 0, len(hashes)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if hashes[mid - 1] in blocks:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def admit(self, replica: str, hashes: Sequence[int]) -> None:
        """Record that the request was sent to the replica: its blocks are now the most recent there."""
        if not hashes:
            return
        blocks = self.replicas.setdefault(replica, OrderedDict())
        for h in reversed(hashes):
            blocks[h] = None
            blocks.move_to_end(h)
        while len(blocks) > self.capacity:
            blocks.popitem(last=False)

    def retain(self, replicas: Iterable[str]) -> None:
        """Forget the replicas that are gone (the routing table no longer lists them)."""
        keep = set(replicas)
        for r in [r for r in self.replicas if r not in keep]:
            del self.replicas[r]

    def size(self) -> int:
        """Blocks held, over every replica."""
        return sum(len(b) for b in self.replicas.values())


def _score(start: bytes, backend_id: str) -> bytes:
    return hashlib.blake2b(start + backend_id.encode(), digest_size=8).digest()


def choose(
    backends: Sequence[Backend],
    *,
    hashes: Sequence[int],
    load: Mapping[str, float],
    start: bytes = b"",
    index: PrefixIndex | None = None,
    exclude: frozenset[str] | set[str] = frozenset(),
    balance: float = DEFAULT_BALANCE,
    slack: int = DEFAULT_SLACK,
) -> Backend | None:
    """The replica for a request with block hashes `hashes` and conversation start `start`; None if none is left."""
    candidates = [b for b in backends if b.id not in exclude]
    if not candidates:
        return None
    total = sum(load.get(b.id, 0) for b in candidates)
    cap = balance * (total + 1) / len(candidates) + slack
    # A conversation whose start (system messages and first user turn) fills a block breaks a tie
    # by the replicas' cached blocks, fewest first: with engines that answer faster than requests
    # come (nothing in flight anywhere), the hash alone put two of four system prompts on one
    # replica and none on another, whose cache then overflowed while the other sat empty. Its
    # later turns match that first block where it went. A shorter start keeps the hash: its first
    # turn leaves no full block for the next to match, and the hash keeps the turns together.
    by_room = index is not None and len(start) >= BLOCK_BYTES
    best: tuple[int, float, int] | None = None
    tied: list[Backend] = []
    for b in candidates:
        busy = load.get(b.id, 0)
        if busy + 1 > cap:
            continue
        # Longest prefix first, then the least loaded, then the emptiest cache.
        rank = (
            -index.matched(b.id, hashes) if index is not None and hashes else 0,
            busy,
            len(index.replicas.get(b.id, ())) if by_room else 0,
        )
        if best is None or rank < best:
            best, tied = rank, [b]
        elif rank == best:
            tied.append(b)
    if not tied:
        # Every replica over the bound (a bound of no slack): the least loaded.
        low = min(load.get(b.id, 0) for b in candidates)
        tied = [b for b in candidates if load.get(b.id, 0) == low]
    if len(tied) == 1:
        return tied[0]
    # Then a stable order per conversation, computed only when it decides.
    return min(tied, key=lambda b: _score(start, b.id))


def round_robin(
    backends: Sequence[Backend], turn: int, *, exclude: frozenset[str] | set[str] = frozenset()
) -> Backend | None:
    """The `turn`-th replica in rotation, skipping excluded ones (the baseline the benchmark compares with)."""
    candidates = [b for b in backends if b.id not in exclude]
    return candidates[turn % len(candidates)] if candidates else None
