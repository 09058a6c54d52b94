"""The routing policy: bounded-load consistent hashing over the conversation's first block (pure)."""

from __future__ import annotations

from collections import Counter

from gateway.routing import choose, prefix_key, round_robin
from gateway.table import Backend

B = [Backend(f"r{i}", f"http://h:{i}", "echo", "", "demo") for i in range(4)]


def _conv(system: str, *turns: str) -> dict:
    msgs = [{"role": "system", "content": system}]
    for i, t in enumerate(turns):
        msgs.append({"role": "user" if i % 2 == 0 else "assistant", "content": t})
    return {"model": "demo", "messages": msgs}


def test_every_turn_of_a_conversation_has_the_same_key():
    first = prefix_key(_conv("You are terse.", "hi"))
    assert prefix_key(_conv("You are terse.", "hi", "hello", "and now?")) == first
    assert prefix_key(_conv("You are terse.", "hi", "hello", "and now?", "x", "y")) == first
    assert prefix_key(_conv("You are terse.", "bye")) != first
    assert prefix_key(_conv("You are verbose.", "hi")) != first


def test_prompts_and_content_parts_and_nothing():
    assert prefix_key({"prompt": "abc"}) == b"abc"
    assert prefix_key({"prompt": ["abc", "d"]}) == b"abc"
    assert prefix_key({"input": "emb"}) == b"emb"
    assert prefix_key({"messages": [{"role": "user", "content": [{"type": "text", "text": "p"}]}]}) == b"user:p\n"
    assert prefix_key({"prompt": ""}) is None
    assert prefix_key({}) is None
    assert len(prefix_key({"prompt": "x" * 10_000})) == 4096


def test_same_key_same_replica_while_loads_are_even():
    key = prefix_key(_conv("sys", "q"))
    picked = {choose(B, key=key, load={}).id for _ in range(5)}
    assert len(picked) == 1


def test_keys_spread_over_replicas():
    picks = Counter(choose(B, key=f"conversation {i}".encode(), load={}).id for i in range(400))
    assert set(picks) == {"r0", "r1", "r2", "r3"}
    assert min(picks.values()) > 60


def test_a_markedly_busier_replica_is_passed_over_then_taken_again():
    key = b"a system prompt"
    home = choose(B, key=key, load={})
    # Busier than balance x mean: the key spills to its next choice, always the same one.
    busy = {home.id: 10, **{b.id: 1 for b in B if b.id != home.id}}
    spill = choose(B, key=key, load=busy)
    assert spill.id != home.id
    assert choose(B, key=key, load=busy).id == spill.id
    # Only a little busier: it keeps its key (its cache is worth a short queue).
    slightly = {home.id: 2, **{b.id: 1 for b in B if b.id != home.id}}
    assert choose(B, key=key, load=slightly).id == home.id
    assert choose(B, key=key, load=busy, slack=0, balance=100).id == home.id


def test_removing_a_replica_moves_only_its_keys():
    keys = [f"k{i}".encode() for i in range(300)]
    before = {k: choose(B, key=k, load={}).id for k in keys}
    after = {k: choose(B[:3], key=k, load={}).id for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert moved and all(before[k] == "r3" for k in moved)


def test_exclusions_and_no_key():
    assert choose(B, key=b"x", load={}, exclude={"r0", "r1", "r2", "r3"}) is None
    assert choose([], key=None, load={}) is None
    assert choose(B, key=None, load={"r0": 2, "r1": 1, "r2": 0, "r3": 3}).id == "r2"
    got = choose(B, key=b"x", load={}, exclude={choose(B, key=b"x", load={}).id})
    assert got is not None and got.id != choose(B, key=b"x", load={}).id


def test_round_robin_baseline():
    assert [round_robin(B, t).id for t in range(5)] == ["r0", "r1", "r2", "r3", "r0"]
    assert [round_robin(B, t, exclude={"r1"}).id for t in range(3)] == ["r0", "r2", "r3"]
    assert round_robin([], 3) is None
