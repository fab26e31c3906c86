"""Pins on LMCache's real CPU and disk tiers: a pinned chunk outlives LMCache's own LRU under a
flood of other chunks, an unpinned one does not; the pin lapses by its TTL, gives way to an
evict, and is bounded by the pod's share of DRAM."""

from __future__ import annotations

import time

import pytest

from agentserving.core.schemas import Tier
from agentserving.engine.model.runner import ModelRunner
from testkit.worker import prompt

CHUNKS = 3  # full chunks per 800-token prompt (256-token chunks)


@pytest.fixture
def small(engine_factory):
    """An engine with about 10 chunks of DRAM and 15 of disk (tiny model: 2 MiB a chunk)."""
    return engine_factory(cpu_cache_gib=0.02, disk_cache_gib=0.03)


def _store(parts, runner, seed: int) -> list[str]:
    ids = prompt(800, seed=seed)
    cache = runner.new_cache()
    runner.forward(ids, cache, 0)
    parts.store.store(ids, runner.cache_layers(cache))
    assert parts.store.wait_disk_writes()
    return [parts.keys.wire_of_int(v) for v in parts.keys.int_hashes(ids)][:CHUNKS]


def _in(parts, tier: Tier) -> set[str]:
    wire = parts.keys.wire_of_int
    return {wire(v) for v in parts.store.residency().get(tier, set())}


def _flood(parts, runner, first_seed: int, prompts: int = 6) -> None:
    for seed in range(first_seed, first_seed + prompts):
        _store(parts, runner, seed)


def test_a_pinned_session_outlives_lmcache_lru_in_dram_and_on_disk(small, tiny):
    runner = ModelRunner(tiny)
    pinned = _store(small, runner, 1)
    control = _store(small, runner, 2)
    out = small.store.pins.pin(pinned, ttl_s=600)
    assert (out.pinned, out.missing, out.refused) == (CHUNKS, 0, 0)
    _flood(small, runner, 100)  # 18 chunks: more than either tier holds
    assert set(pinned) <= _in(small, Tier.CPU)
    assert set(pinned) <= _in(small, Tier.DISK)
    assert not set(control) & _in(small, Tier.CPU)  # the same age, unpinned: gone
    assert not set(control) & _in(small, Tier.DISK)
    # released, the tiers' own LRU takes them like any other chunk
    assert small.store.pins.unpin(pinned) == CHUNKS
    _flood(small, runner, 200)
    assert not set(pinned) & _in(small, Tier.CPU)


def test_a_pin_lapses_by_itself_and_pinning_again_extends_it(small, tiny):
    runner = ModelRunner(tiny)
    chunks = _store(small, runner, 3)
    assert small.store.pins.pin(chunks, ttl_s=0.3).pinned == CHUNKS
    assert small.store.pins.pin(chunks[:1], ttl_s=600).extended == 1
    deadline = time.monotonic() + 10
    while len(small.store.pins) > 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(small.store.pins) == 1 and small.store.pins.pinned(chunks[0])
    _flood(small, runner, 300)
    assert chunks[0] in _in(small, Tier.CPU)
    assert not set(chunks[1:]) & _in(small, Tier.CPU)


def test_pins_are_bounded_by_the_share_of_dram_and_an_evict_takes_a_pinned_chunk(
        engine_factory, tiny):
    parts = engine_factory(cpu_cache_gib=0.02, disk_cache_gib=0.03, pin_share=0.4)
    runner = ModelRunner(tiny)
    bound = parts.store.pins.max_chunks
    assert 1 <= bound < 2 * CHUNKS
    first, second = _store(parts, runner, 4), _store(parts, runner, 5)
    out_first = parts.store.pins.pin(first, ttl_s=600)
    out_second = parts.store.pins.pin(second, ttl_s=600)
    assert out_first.pinned + out_second.pinned == bound
    assert out_first.refused + out_second.refused == 2 * CHUNKS - bound
    unknown = parts.store.pins.pin(["ab" * 16], ttl_s=600)
    assert (unknown.missing, unknown.pinned) == (1, 0)
    # an evict (a close, the kvindex's fan-out) removes a pinned chunk from every tier and
    # the book forgets it: the bound frees up for the next pin
    evicted, _ = parts.store.evict(first[:1], parts.store.backends)
    assert evicted == first[:1] and not parts.store.pins.pinned(first[0])
    assert first[0] not in _in(parts, Tier.CPU) | _in(parts, Tier.DISK)
    assert len(parts.store.pins) == bound - 1


def _prefetch(client, chunks: list[str], lookup_id: str, **extra) -> dict:
    r = client.post("/memory/prefetch", json={"chunk_hashes": chunks, "lookup_id": lookup_id,
                                             **extra})
    assert r.status_code == 200, r.text
    deadline = time.monotonic() + 10
    while client.get(f"/memory/prefetch/{lookup_id}").json()["state"] == "running":
        assert time.monotonic() < deadline
        time.sleep(0.02)
    return r.json()


def test_an_announce_hold_keeps_the_turns_kv_in_dram_read_or_already_there(small, tiny):
    # an announced turn's context, half in DRAM and half on disk only: the memory API's
    # prefetch with hold_s pins what DRAM holds at once and the rest once it is read in, so a
    # flood of other sessions' KV before the turn arrives leaves all of it in DRAM; the same
    # prefetch without a hold is flushed like any other chunk
    from fastapi.testclient import TestClient

    from agentserving.engine.memory_api import engine_memory_app

    runner = ModelRunner(tiny)
    held, plain = _store(small, runner, 7), _store(small, runner, 8)
    for chunks in (held, plain):  # the first chunk left DRAM: on disk only
        assert small.store.evict(chunks[:1], ["LocalCPUBackend"])[0] == chunks[:1]
    with TestClient(engine_memory_app(small.store)) as client:
        out = _prefetch(client, held, "tool-gap:held", expected_in_s=1.0, hold_s=600)
        assert (out["num_to_load"], out["num_in_cpu"], out["num_held"]) == (1, CHUNKS - 1,
                                                                           CHUNKS)
        assert _prefetch(client, plain, "tool-gap:plain")["num_held"] == 0
        assert set(held) | set(plain) <= _in(small, Tier.CPU)  # both read in
        _flood(small, runner, 400)
        assert set(held) <= _in(small, Tier.CPU)
        assert not set(plain) & _in(small, Tier.CPU)
        r = client.post("/memory/prefetch", json={"chunk_hashes": held, "hold_s": 0})
        assert r.status_code == 400 and "hold_s" in r.text
