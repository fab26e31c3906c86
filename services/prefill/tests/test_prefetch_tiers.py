"""The prefill bench's DRAM/disk tier model: pinned prefetches survive LRU pressure until
they are unpinned, within the pin cap (what the bench's survival and consumption rest on)."""

from __future__ import annotations

from testkit.servers import import_bench

bench = import_bench("prefill_sched_bench")


def test_pinned_prefetch_survives_lru_pressure_until_unpinned():
    t = bench.Tiers(dram_chunks=4, disk_s=1.0, pin_share=0.5)
    t.prefetch(("p1", "p2"), now=0.0, pin=True)
    assert t.in_flight("p1", 0.5) and not t.in_dram("p1", 0.5)
    assert t.in_dram("p1", 1.0) and t.in_flight("p2", 1.0)  # one disk queue: 1 s a chunk
    for i in range(10):  # new KV floods the LRU
        t.put(f"n{i}")
    assert t.in_dram("p1", 2.0) and t.in_dram("p2", 2.0)  # pinned: never evicted
    assert len(t.lru) + len(t.pinned) == 4  # pins count against the DRAM size
    t.unpin(("p1", "p2"))
    for i in range(10, 14):
        t.put(f"n{i}")
    assert not t.in_dram("p1", 3.0) and not t.in_dram("p2", 3.0)  # plain LRU again


def test_pins_past_the_cap_land_in_the_lru_and_can_be_evicted():
    t = bench.Tiers(dram_chunks=4, disk_s=1.0, pin_share=0.5)
    t.prefetch(("a", "b", "c"), now=0.0, pin=True)
    t.settle(3.0)
    assert t.pinned == {"a", "b"} and "c" in t.lru  # cap: 2 of 4 chunks
    for i in range(2):
        t.put(f"n{i}")
    assert not t.in_dram("c", 3.0) and t.in_dram("a", 3.0)
    # without pin the prefetched chunk is a plain LRU entry from the start
    u = bench.Tiers(dram_chunks=2, disk_s=1.0)
    u.prefetch(("x",), now=0.0)
    u.settle(1.0)
    u.put("y")
    u.put("z")
    assert not u.in_dram("x", 1.0)
