"""The embedded default's file cache: incr and add hold across processes, as the change feed needs."""

from __future__ import annotations

import multiprocessing as mp

import pytest

from llmgw.file_cache import LOCK_NAME, FileCache

PROCESSES = 4
EACH = 150


def _incr_many(backend: str, location: str, start: mp.Event, out: mp.Queue) -> None:
    cache = _cache(backend, location)
    start.wait()
    out.put([cache.incr("counter") for _ in range(EACH)])


def _add_once(backend: str, location: str, start: mp.Event, out: mp.Queue) -> None:
    cache = _cache(backend, location)
    start.wait()
    out.put(sum(cache.add(f"key-{i}", "mine", timeout=None) for i in range(EACH)))


def _cache(backend: str, location: str):
    # `backend` names the class under test; only the project's is used here (Django's own
    # FileBasedCache fails test_incr_gives_every_process_its_own_number: duplicate numbers).
    assert backend == "file_cache"
    return FileCache(location, {"TIMEOUT": None})


def _race(target, backend: str, location: str) -> list:
    ctx = mp.get_context("fork")
    start, out = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=target, args=(backend, location, start, out)) for _ in range(PROCESSES)]
    for p in procs:
        p.start()
    start.set()
    results = [out.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    return results


def test_incr_gives_every_process_its_own_number(tmp_path):
    _cache("file_cache", str(tmp_path)).set("counter", 0)
    results = _race(_incr_many, "file_cache", str(tmp_path))
    taken = [v for r in results for v in r]
    # Every increment counted once, and no two callers handed the same version (the change feed's rule).
    assert sorted(taken) == list(range(1, PROCESSES * EACH + 1))
    assert _cache("file_cache", str(tmp_path)).get("counter") == PROCESSES * EACH


def test_add_lets_exactly_one_process_set_each_key(tmp_path):
    results = _race(_add_once, "file_cache", str(tmp_path))
    assert sum(results) == EACH


def test_incr_of_a_missing_key_still_raises_and_the_lock_file_is_no_entry(tmp_path):
    cache = _cache("file_cache", str(tmp_path))
    with pytest.raises(ValueError):
        cache.incr("absent")
    assert (tmp_path / LOCK_NAME).exists()
    cache.set("a", 1)
    cache.clear()
    assert cache.get("a") is None
    assert (tmp_path / LOCK_NAME).exists()


def test_incr_then_set_takes_the_next_number_and_stores_its_entry(tmp_path):
    cache = _cache("file_cache", str(tmp_path))
    with pytest.raises(ValueError):
        cache.incr_then_set("counter", "entry:", ["node-a"], timeout=30)
    assert cache.get("entry:1") is None
    cache.set("counter", 6)
    assert cache.incr_then_set("counter", "entry:", ["node-a"], timeout=30) == 7
    assert (cache.get("counter"), cache.get("entry:7")) == (7, ["node-a"])


def test_touch_and_read_renews_every_key_and_reads_those_asked(tmp_path):
    cache = FileCache(str(tmp_path), {"TIMEOUT": 300})
    cache.set("entry-a", {"gpus": [1]}, timeout=5)
    cache.set("digest-a", "d1", timeout=5)
    touched, values = cache.touch_and_read(["entry-a", "entry-b"], ["digest-a", "digest-b"], timeout=120)
    assert (touched, values) == ({"entry-a"}, {"digest-a": "d1"})
    assert cache.get("entry-a") == {"gpus": [1]}
