"""The byte-bounded LRU on its own: order, bound, refusal, replacement, eviction by chunk."""

from __future__ import annotations

import random
import threading

import pytest

from agentserving.engine.kvserver.store import Blob, BlobStore, HeldByPin, PinResult


def blob(key: str, size: int, chunk: str | None = None) -> Blob:
    return Blob(key, chunk or key.split("/")[0], "fmt", "dtype", (size,), bytes([len(key)]) * size)


def test_evicts_least_recently_used_first_and_get_refreshes():
    store = BlobStore(300)
    for key in ("a", "b", "c"):
        assert store.put(blob(key, 100)).stored
    assert store.get("a") is not None  # a is now the most recent: b goes first
    assert store.contains("b")  # a probe is no use: b stays least recent
    result = store.put(blob("d", 100))
    assert (result.stored, result.evicted_keys, result.evicted_bytes) == (True, 1, 100)
    assert store.lru_keys() == ["c", "a", "d"]
    result = store.put(blob("e", 150))  # needs two evictions: c then a
    assert (result.evicted_keys, result.evicted_bytes) == (2, 200)
    assert store.lru_keys() == ["d", "e"] and store.used_bytes == 250


def test_the_bound_is_never_exceeded():
    rng = random.Random(7)
    store = BlobStore(10_000)
    for i in range(2000):
        store.put(blob(f"{rng.randrange(50):x}/{i % 3}", rng.randrange(1, 4000)))
        assert store.used_bytes <= store.capacity_bytes
        assert store.used_bytes == sum(store.get(k).length for k in store.lru_keys())


def test_a_blob_larger_than_the_bound_is_refused_and_evicts_nothing():
    store = BlobStore(100)
    store.put(blob("a", 60))
    result = store.put(blob("big", 101))
    assert not result.stored and result.evicted_keys == 0
    assert store.lru_keys() == ["a"] and not store.contains("big")
    assert store.put(blob("exact", 100)).stored  # exactly the bound fits
    assert store.lru_keys() == ["exact"] and store.used_bytes == 100


def test_put_under_a_held_key_replaces_it_without_an_eviction():
    store = BlobStore(300)
    store.put(blob("a", 100))
    store.put(blob("b", 100))
    result = store.put(blob("a", 200))  # 100 freed by the replacement, 200 fit exactly
    assert (result.stored, result.evicted_keys) == (True, 0)
    assert store.used_bytes == 300 and store.get("a").length == 200
    assert store.lru_keys() == ["b", "a"] and len(store) == 2


def test_evict_chunks_removes_every_key_of_those_chunks_only():
    store = BlobStore(10_000)
    for key, size in (("aa/0", 10), ("aa/1", 20), ("bb/0", 30), ("cc/0", 40)):
        store.put(blob(key, size))
    assert store.keys_of(["aa", "zz"]) == ["aa/0", "aa/1"]
    done = store.evict_chunks(["aa", "zz", "cc", "aa"])
    assert sorted(done.keys) == ["aa/0", "aa/1", "cc/0"] and done.freed_bytes == 70
    assert done.chunks == ["aa", "cc"] and done.missing == ["zz"]
    assert store.lru_keys() == ["bb/0"] and store.used_bytes == 30 and store.num_chunks == 1
    assert not store.has_chunk("aa") and store.has_chunk("bb")


def test_listing_pages_by_chunk_hash_with_keys_and_bytes():
    store = BlobStore(10_000)
    for key, size in (("cc/0", 5), ("aa/0", 1), ("aa/1", 2), ("bb/0", 3)):
        store.put(blob(key, size))
    total, page = store.listing(0, 2)
    assert total == 3
    assert [(e.chunk, e.keys, e.bytes) for e in page] == [("aa", ["aa/0", "aa/1"], 3),
                                                          ("bb", ["bb/0"], 3)]
    assert [e.chunk for e in store.listing(2, 10)[1]] == ["cc"]


def test_concurrent_puts_keep_the_books_straight():
    store = BlobStore(50_000)

    def writer(n: int) -> None:
        rng = random.Random(n)
        for i in range(500):
            store.put(blob(f"{n:x}{i % 40:x}/0", rng.randrange(1, 3000)))
            store.get(f"{n:x}{rng.randrange(40):x}/0")

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert store.used_bytes <= store.capacity_bytes
    assert store.used_bytes == sum(store.get(k).length for k in store.lru_keys())
    assert sum(e.bytes for e in store.listing()[1]) == store.used_bytes


def test_capacity_must_be_positive():
    with pytest.raises(ValueError, match="capacity_bytes"):
        BlobStore(0)


def test_pinned_chunks_survive_the_lru_within_their_share_and_give_way_past_it():
    now = [0.0]
    store = BlobStore(1000, pin_share=0.3, clock=lambda: now[0])
    for key in ("a/0", "b/0", "c/0", "d/0", "e/0"):  # a is the least recently used
        store.put(blob(key, 200))
    assert store.pin(["a", "b", "zz"], ttl_s=10) == PinResult(pinned=2, missing=1)
    assert store.held_by_pin() == HeldByPin(2, 400, 3, 600)
    # 400 pinned bytes are past the 300 of the share: the oldest pinned (a) goes as any other
    store.put(blob("f/0", 200))
    assert not store.contains("a/0") and store.contains("b/0")
    # b (200) is within the share now: the LRU passes over it, c goes
    store.put(blob("g/0", 200))
    assert store.contains("b/0") and not store.contains("c/0")
    assert store.lru_keys()[0] == "b/0" and store.pinned("b")
    assert store.pin(["b"], ttl_s=20).extended == 1
    now[0] = 15.0  # past the first TTL, within the extension
    store.put(blob("h/0", 200))
    assert store.contains("b/0") and not store.contains("d/0")
    now[0] = 20.0  # lapsed: b is the oldest and goes first
    store.put(blob("i/0", 200))
    assert not store.contains("b/0") and store.held_by_pin().pinned_chunks == 0


def test_pins_never_refuse_room_and_unpin_or_eviction_gives_them_back():
    store = BlobStore(400, pin_share=1.0)
    for key in ("a/0", "b/0"):
        store.put(blob(key, 200))
    assert store.pin(["a", "b"], ttl_s=60).pinned == 2
    result = store.put(blob("c/0", 300))  # only pinned blobs left: they go, oldest first
    assert result.stored and result.evicted_keys == 2 and store.lru_keys() == ["c/0"]
    assert store.held_by_pin().pinned_chunks == 0  # gone with their chunks
    store.put(blob("d/0", 100))
    assert store.pin(["c", "d"], ttl_s=60).pinned == 2
    assert store.unpin(["c", "zz"]) == 1 and not store.pinned("c") and store.pinned("d")
    entries = {e.chunk: e.pinned for e in store.listing()[1]}
    assert entries == {"c": False, "d": True}
    assert store.evict_chunks(["d"]).chunks == ["d"] and not store.pinned("d")
    with pytest.raises(ValueError):
        BlobStore(100, pin_share=1.5)
