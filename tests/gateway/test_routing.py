"""The routing policy: the longest cached prefix within a load bound, over a bounded prefix index (pure)."""

from __future__ import annotations

import sys
from collections import Counter

from gateway.routing import (
    BLOCK_BYTES,
    MAX_BLOCKS,
    PrefixIndex,
    block_hashes,
    choose,
    conversation_start,
    rendered,
    round_robin,
)
from gateway.table import Backend

B = [Backend(f"r{i}", f"http://h:{i}", "echo", "", "demo") for i in range(4)]
# A system prompt of a few blocks, as the benchmark's ~300-word ones.
SYSTEM = " ".join(f"rule{i}" for i in range(300))


def _conv(system: str, *turns: str) -> dict:
    msgs = [{"role": "system", "content": system}]
    for i, t in enumerate(turns):
        msgs.append({"role": "user" if i % 2 == 0 else "assistant", "content": t})
    return {"model": "demo", "messages": msgs}


def _route(index: PrefixIndex, body: dict, load: dict | None = None) -> str:
    """Route as the data plane does: choose, then record the request as sent there."""
    hashes = block_hashes(body)
    got = choose(B, hashes=hashes, start=conversation_start(body), load=load or {}, index=index)
    index.admit(got.id, hashes)
    return got.id


def test_rendered_prompt_and_its_chained_blocks():
    assert rendered(_conv("sys", "hi", "yo", "again")) == b"system\nsys\nuser\nhi\nassistant\nyo\nuser\nagain\n"
    assert rendered({"prompt": ["abc", "d"]}) == b"abc"
    assert rendered({"input": "emb"}) == b"emb"
    assert rendered({"messages": [{"role": "user", "content": [{"type": "text", "text": "p"}]}]}) == b"user\np\n"
    assert block_hashes({"prompt": ""}) == ()
    assert block_hashes({}) == ()
    assert len(block_hashes({"prompt": "x" * (3 * BLOCK_BYTES + 1)})) == 4
    assert len(block_hashes({"prompt": "x" * (BLOCK_BYTES * MAX_BLOCKS * 2)})) == MAX_BLOCKS
    # Chained: the same block after a different start is a different block.
    a, b = (
        block_hashes({"prompt": "a" * BLOCK_BYTES + "z" * BLOCK_BYTES}),
        block_hashes({"prompt": "b" * BLOCK_BYTES + "z" * BLOCK_BYTES}),
    )
    assert a[1] != b[1]
    # A later turn extends the earlier one's blocks: every full block of the first turn is its prefix.
    first, later = block_hashes(_conv(SYSTEM, "hi")), block_hashes(_conv(SYSTEM, "hi", "hello", "and now?"))
    assert later[: len(first) - 1] == first[: len(first) - 1]


def test_a_shared_system_prompt_routes_to_its_holder():
    index = PrefixIndex()
    home = _route(index, _conv(SYSTEM, "the first session's question"))
    # New sessions with the same system prompt go where it is, while loads stay within the bound.
    assert [_route(index, _conv(SYSTEM, f"session {i} asks")) for i in range(6)] == [home] * 6
    # One with another system prompt, on an idle fleet, goes to the least loaded: not the busy holder.
    other = _route(index, _conv("another long preamble " * 40, "q"), load={home: 3})
    assert other != home


def test_later_turns_follow_their_history_not_the_shared_prompt():
    index = PrefixIndex()
    # Two sessions over one system prompt forced apart: the second spilled while the first was busy.
    a = _route(index, _conv(SYSTEM, "alpha " * 60))
    b = _route(index, _conv(SYSTEM, "beta " * 60), load={a: 20})
    assert a != b
    # Each session's next turn goes where its own history is, though both replicas hold the system prompt.
    assert _route(index, _conv(SYSTEM, "alpha " * 60, "reply", "more")) == a
    assert _route(index, _conv(SYSTEM, "beta " * 60, "reply", "more")) == b


def test_a_full_replica_spills_to_the_next_longest_prefix():
    index = PrefixIndex()
    body = _conv(SYSTEM, "q")
    home = _route(index, body)
    # Busier than 1.25 x the mean + 4: passed over, for the least loaded one.
    busy = {home: 10, **{b.id: 1 for b in B if b.id != home}}
    spill = _route(index, body, load=busy)
    assert spill != home
    # Now two replicas hold it: with the first still full, the spill keeps it.
    assert _route(index, _conv(SYSTEM, "another"), load=busy) == spill
    # Only a little busier: the holder keeps its prefix (its cache is worth a short queue).
    slightly = {home: 2, spill: 5, **{b.id: 1 for b in B if b.id not in (home, spill)}}
    assert _route(index, _conv(SYSTEM, "a third"), load=slightly) == home
    # With no bound, the only holder keeps it however busy.
    alone = PrefixIndex()
    alone.admit("r2", block_hashes(body))
    loads = {"r2": 10, "r0": 1, "r1": 1, "r3": 1}
    assert choose(B, hashes=block_hashes(body), load=loads, index=alone, slack=0, balance=100).id == "r2"
    assert choose(B, hashes=block_hashes(body), load=loads, index=alone).id != "r2"


def test_an_aged_out_prefix_is_forgotten():
    index = PrefixIndex(capacity=64)
    body = _conv(SYSTEM, "q")
    hashes = block_hashes(body)
    home = _route(index, body)
    assert index.matched(home, hashes) == len(hashes)
    # The replica is then sent 64 blocks of other prompts: the engine's LRU would have evicted the first.
    for i in range(8):
        index.admit(home, block_hashes({"prompt": f"other prompt {i} " * 64}))
    assert index.matched(home, hashes) == 0
    # With nothing cached anywhere it goes to the least loaded, not back to its old place.
    assert _route(index, body, load={home: 2}) != home


def test_a_prompts_start_is_the_last_of_it_forgotten():
    index = PrefixIndex(capacity=12)
    long = block_hashes({"prompt": "y" * (10 * BLOCK_BYTES)})
    index.admit("r0", long)
    index.admit("r0", block_hashes({"prompt": "q" * (4 * BLOCK_BYTES)}))
    # Two blocks had to go: the prompt's tail, so its first eight still match.
    assert index.matched("r0", long) == 8


def test_memory_stays_bounded():
    index = PrefixIndex(capacity=100)
    for i in range(2000):
        index.admit(B[i % 4].id, block_hashes({"prompt": f"prompt {i} " * 50}))
    assert index.size() == 400
    assert all(len(blocks) == 100 for blocks in index.replicas.values())
    # A replica leaving the table leaves the index.
    index.retain(["r0", "r1"])
    assert sorted(index.replicas) == ["r0", "r1"] and index.size() == 200
    # At most 250 bytes a block (about 120 in a full index): a full default index of one replica stays under 1 MB.
    held = sum(sys.getsizeof(h) for blocks in index.replicas.values() for h in blocks)
    assert held + sum(sys.getsizeof(b) for b in index.replicas.values()) < 200 * 250


def test_new_prompts_spread_over_replicas():
    index = PrefixIndex()
    load: Counter = Counter()
    for i in range(40):
        got = _route(index, _conv(f"system prompt {i} " * 30, "q"), load=dict(load))
        load[got] += 1  # each stays in flight: new prompts go to the least loaded
    assert sorted(load.values()) == [10, 10, 10, 10]


def test_new_prompts_spread_by_cached_blocks_when_nothing_is_in_flight():
    # An engine answering faster than requests come: every load reads 0, and the emptiest cache
    # takes each new prompt (the hash alone gave 2/2/2/2 about one time in 26).
    index = PrefixIndex()
    picks = Counter(_route(index, _conv(f"system prompt {i:02d} " * 30, "q")) for i in range(8))
    assert sorted(picks.values()) == [2, 2, 2, 2]
    # Each prompt's later turns still go where it is.
    for i in range(8):
        first = choose(B, hashes=block_hashes(_conv(f"system prompt {i:02d} " * 30, "q")), load={}, index=index)
        again = _route(index, _conv(f"system prompt {i:02d} " * 30, "q", "a", "q2"))
        assert again == first.id


def test_a_short_started_conversation_keeps_its_replica_as_it_grows_past_a_block():
    # Its first turn leaves no full block to match: the emptiest cache must not pull it away.
    index = PrefixIndex()
    turns = ["conversation 0 question 0", "a reply " * 10, "conversation 0 question 1", "more " * 20, "q2"]
    first = _route(index, _conv("You are a helpful assistant.", *turns[:1]))
    index.admit(first, block_hashes({"prompt": "another conversation " * 100}))  # its cache the fullest
    assert {_route(index, _conv("You are a helpful assistant.", *turns[:n])) for n in (3, 5)} == {first}


def test_the_conversations_start_is_what_every_turn_shares():
    first = conversation_start(_conv("You are terse.", "hi"))
    assert first == b"system\nYou are terse.\nuser\nhi\n"
    assert conversation_start(_conv("You are terse.", "hi", "hello", "and now?")) == first
    assert conversation_start(_conv("You are terse.", "bye")) != first
    assert conversation_start({"prompt": "x" * 5000}) == b"x" * 1024


def test_a_conversation_shorter_than_a_block_keeps_to_one_replica():
    index = PrefixIndex()
    places = set()
    msgs = ["hi", "hello", "and now?", "fine", "bye"]
    for n in (1, 3, 5):
        places.add(_route(index, _conv("Be brief.", *msgs[:n])))
    assert len(places) == 1


def test_an_empty_index_places_a_conversation_stably_and_conversations_spread():
    picks = Counter(choose(B, hashes=(), start=f"conversation {i}".encode(), load={}).id for i in range(400))
    assert set(picks) == {"r0", "r1", "r2", "r3"}
    assert min(picks.values()) > 60
    assert len({choose(B, hashes=(), start=b"p", load={}).id for _ in range(5)}) == 1


def test_exclusions_and_no_prompt():
    assert choose(B, hashes=block_hashes({"prompt": "x"}), load={}, exclude={"r0", "r1", "r2", "r3"}) is None
    assert choose([], hashes=(), load={}) is None
    assert choose(B, hashes=(), load={"r0": 2, "r1": 1, "r2": 0, "r3": 3}).id == "r2"
    index = PrefixIndex()
    index.admit("r1", block_hashes({"prompt": "x"}))
    got = choose(B, hashes=block_hashes({"prompt": "x"}), load={}, index=index, exclude={"r1"})
    assert got is not None and got.id != "r1"


def test_round_robin_baseline():
    assert [round_robin(B, t).id for t in range(5)] == ["r0", "r1", "r2", "r3", "r0"]
    assert [round_robin(B, t, exclude={"r1"}).id for t in range(3)] == ["r0", "r2", "r3"]
    assert round_robin([], 3) is None
