"""Late, failed and on-time prefetches: a fetch that finds a chunk's disk -> DRAM
prefetch in flight waits for that read instead of reading the file a second time; a prefetch
later than ``prefetch_wait_s`` or one that failed leaves the fetch to read and verify the disk
itself. The layer copy's two paths (one contiguous run of blocks, a fragmented table) and the
ShadowScheduler's N+1 prefetch on the real engine end to end. Every restored KV is compared
with the bytes stored or with a recompute, bit for bit."""

from __future__ import annotations

import dataclasses
import threading
import types

import pytest
import torch

from agentserving.core.schemas import Tier
from agentserving.engine.kv import layerwise
from agentserving.engine.kv.paged import KVBlockPool
from agentserving.engine.model.runner import ModelRunner
from testkit.worker import prompt, request, run


def fake_chunks(tiny, n: int, seed: int) -> list:  # type: ignore[no-untyped-def]
    """``n`` LMCache-like memory objects of random 256-token chunks (``.tensor`` is
    ``[2, layers, tokens, kv_heads * head_dim]``)."""
    g = torch.Generator().manual_seed(seed)
    width = tiny.num_kv_heads * tiny.head_dim
    return [types.SimpleNamespace(tensor=torch.randn(2, tiny.num_layers, 256, width,
                                                     generator=g).to(tiny.dtype))
            for _ in range(n)]


def test_the_worker_setting_sets_how_long_a_fetch_waits(engine_factory):
    assert engine_factory(prefetch_wait_s=0.25).store.config.prefetch_wait_s == 0.25


def assert_holds_chunks(kv, objs: list, tiny) -> None:  # type: ignore[no-untyped-def]
    """Every layer of ``kv`` holds ``objs``' chunks, in order, bit for bit."""
    for layer in range(tiny.num_layers):
        k, v = kv.view(layer, 256 * len(objs), copy=True)
        for j, obj in enumerate(objs):
            want = obj.tensor.view(2, tiny.num_layers, 256, tiny.num_kv_heads, tiny.head_dim)
            assert torch.equal(k[0, :, j * 256:(j + 1) * 256], want[0, layer].transpose(0, 1))
            assert torch.equal(v[0, :, j * 256:(j + 1) * 256], want[1, layer].transpose(0, 1))


@pytest.fixture
def on_disk(engine_factory, tiny):
    """An engine whose store holds the 3 full chunks of a 900-token prompt on disk only."""
    parts = engine_factory()
    runner = ModelRunner(tiny)
    ids = prompt(900, seed=61)
    cache = runner.new_cache()
    runner.forward(ids, cache, 0)
    layers = runner.cache_layers(cache)
    store = parts.store
    assert store.store(ids, layers) == 3
    assert store.wait_disk_writes(60)
    ints = parts.keys.int_hashes(ids)
    wire = [parts.keys.wire_of_int(v) for v in ints]
    store.evict(wire, store.resolve_locations(["cpu"]))
    assert store.lookup(ints) == [Tier.DISK] * 3
    return parts, layers, ints, wire


def _same(layers, loaded, n):
    return all(torch.equal(k[:, :, :n], lk) and torch.equal(v[:, :, :n], lv)
               for (k, v), (lk, lv) in zip(layers, loaded, strict=True))


def _gate_prefetch_reads(store, monkeypatch):
    """Hold the prefetch thread's disk reads until ``gate`` is set (``reading`` is set once
    the read is under way); record who read."""
    gate, reading, readers = threading.Event(), threading.Event(), []
    original = store._disk_read

    def read(keys):
        name = threading.current_thread().name
        readers.append(name)
        if name.startswith("kv-prefetch"):
            reading.set()
            assert gate.wait(60)
        return original(keys)

    monkeypatch.setattr(store, "_disk_read", read)
    return gate, reading, readers


def test_fetch_waits_for_the_inflight_prefetch_and_reads_nothing_twice(on_disk, monkeypatch):
    parts, layers, ints, wire = on_disk
    store = parts.store
    gate, reading, readers = _gate_prefetch_reads(store, monkeypatch)

    class OpensGateOnWait(threading.Event):
        def wait(self, timeout=None):  # the fetch is waiting on the prefetch: let it read
            gate.set()
            return super().wait(timeout)

    def mark(keys):
        with store._inflight_lock:
            for key in keys:
                store._inflight.setdefault(key.chunk_hash, [OpensGateOnWait(), False])

    monkeypatch.setattr(store, "_mark_inflight", mark)
    status = store.prefetch(wire, "late-but-awaited")
    assert reading.wait(60)  # the prefetch's read is under way (and held)
    res = store.load_prefix(ints)  # on this thread, while the prefetch's read is held
    assert res.num_tokens == 768 and res.tokens_by_tier == {Tier.CPU: 768}
    assert _same(layers, res.layers, 768)
    assert len(readers) == 1 and readers[0].startswith("kv-prefetch")  # one read of the files
    assert store.stats.prefetch_waits == 1 and store.stats.prefetch_late == 0
    assert status.state == "done" and status.loaded == 3
    assert store._inflight == {}


def test_a_prefetch_later_than_the_wait_limit_leaves_the_fetch_to_read_the_disk(
        on_disk, monkeypatch):
    parts, layers, ints, wire = on_disk
    store = parts.store
    gate, reading, readers = _gate_prefetch_reads(store, monkeypatch)
    store.config = dataclasses.replace(store.config, prefetch_wait_s=0.05)
    status = store.prefetch(wire, "too-late")
    assert reading.wait(60)
    res = store.load_prefix(ints)  # the prefetch's read stays held until after this
    assert res.num_tokens == 768 and res.tokens_by_tier == {Tier.DISK: 768}
    assert _same(layers, res.layers, 768)
    assert store.stats.prefetch_late == 1
    gate.set()
    store._prefetches._pool.submit(lambda: None).result(60)  # the prefetch thread is idle
    assert status.state == "done"  # the chunks it finds in DRAM already count as loaded
    assert store.lookup(ints) == [Tier.CPU] * 3
    assert sum(r.startswith("kv-prefetch") for r in readers) <= 1


def test_a_prefetch_still_queued_is_not_waited_for(on_disk, monkeypatch):
    """A prefetch queued behind another one has not started reading: the fetch reads the
    chunks itself at once, and the queued prefetch then finds them in DRAM and skips them."""
    parts, layers, ints, wire = on_disk
    store = parts.store
    store.config = dataclasses.replace(store.config, prefetch_wait_s=120.0)
    hold = threading.Event()
    store._prefetches._pool.submit(hold.wait, 60)  # the prefetch thread is busy elsewhere
    status = store.prefetch(wire, "queued")
    assert status.state == "running" and len(store._inflight) == 3
    res = store.load_prefix(ints)
    assert res.num_tokens == 768 and res.tokens_by_tier == {Tier.DISK: 768}
    assert _same(layers, res.layers, 768)
    assert store.stats.prefetch_waits == 0
    hold.set()
    store._prefetches._pool.submit(lambda: None).result(60)
    assert status.state == "done" and status.loaded == 3  # in DRAM already: nothing read
    assert store.stats.prefetched_chunks == 0 and store._inflight == {}


def test_a_failed_prefetch_leaves_the_chunks_on_disk_for_the_fetch(on_disk, monkeypatch):
    parts, layers, ints, wire = on_disk
    store = parts.store
    original = store._disk_read

    def read(keys):
        if threading.current_thread().name.startswith("kv-prefetch"):
            raise OSError("simulated disk error during prefetch")
        return original(keys)

    monkeypatch.setattr(store, "_disk_read", read)
    status = store.prefetch(wire, "fails")
    res = store.load_prefix(ints)  # waits for the failure (or finds no read in flight)
    assert res.num_tokens == 768 and _same(layers, res.layers, 768)
    assert res.tokens_by_tier == {Tier.DISK: 768}
    store._prefetches._pool.submit(lambda: None).result(60)  # the prefetch thread is idle
    assert status.state == "failed" and "simulated" in (status.error or "")
    assert store._inflight == {}
    with store.disk.disk_lock:  # its pins were released
        assert all(meta.pin_count == 0 for meta in store.disk.dict.values())


@pytest.mark.parametrize("fragmented", [False, True])
def test_layer_copy_lands_every_chunk_on_both_table_kinds(tiny, fragmented):
    """The contiguous path (one cat per K and V per layer) and the per-chunk scatter path put
    the same bytes where the attention reads them."""
    pool = KVBlockPool(tiny.num_layers, 32, 64, tiny.num_kv_heads, tiny.head_dim, tiny.dtype)
    if fragmented:
        taken = [pool.reserve(64) for _ in range(pool.num_free_blocks)]
        for kv in taken[::2]:
            kv.release()
    kv = pool.reserve(3 * 256 + 10)
    assert kv.consecutive is not fragmented
    objs = fake_chunks(tiny, 3, seed=7)
    copy = layerwise.chunk_copier(objs, kv, 256)
    for layer in range(tiny.num_layers):
        copy(layer)
    assert_holds_chunks(kv, objs, tiny)


def test_shadow_prefetch_serves_queued_disk_turns_from_dram_bit_identical(engine_factory):
    """A busy pod (one running at a time) under the ``shadow`` policy: every queued turn's
    prefix is on disk only; the turn predicted for the next step is prefetched to DRAM, so the
    engine reads it from DRAM, and every output equals a recompute's."""
    sessions = [prompt(600, seed=70 + i) for i in range(3)]
    turns = [ids + prompt(40, seed=80 + i) for i, ids in enumerate(sessions)]
    ref_parts = engine_factory()
    reference = [run(ref_parts, request(f"ref{i}", t, max_tokens=3)) for i, t in enumerate(turns)]
    parts = engine_factory(scheduler_policy="shadow", max_running_requests=1)
    core, store = parts.core, parts.store
    store.config = dataclasses.replace(store.config, prefetch_wait_s=120.0)  # never "late"
    for i, ids in enumerate(sessions):
        run(parts, request(f"warm{i}", ids, max_tokens=1))
    assert store.wait_disk_writes(60)
    for ids in sessions:
        ints = parts.keys.int_hashes(ids)
        store.evict([parts.keys.wire_of_int(v) for v in ints], store.resolve_locations(["cpu"]))
    original = store.prefetch

    def prefetch_then_settle(hashes, lookup_id):
        # the read finishes before the step goes on, however slow this host is: the test
        # is about what the shadow asks for and what the engine then serves (the timing of
        # late prefetches is the store tests' business)
        status = original(hashes, lookup_id)
        store._prefetches._pool.submit(lambda: None).result(60)
        return status

    store.prefetch = prefetch_then_settle
    for i, t in enumerate(turns):
        core.add(request(f"t{i}", t, max_tokens=3))
    outs: dict[str, list] = {}
    while core.has_work():
        for o in core.step():
            outs.setdefault(o.req_id, []).append(o)
        core.run_deferred()
    asked = [rid for rid, _ in core.policy.prefetch_log]
    assert asked == ["t1", "t2"]  # the queue's later turns, each once; t0 ran at once
    assert outs["t0"][0].meta["cached_tokens_by_tier"] == {"disk": 512}
    for rid in ("t1", "t2"):
        assert outs[rid][0].meta["cached_tokens_by_tier"] == {"cpu": 512}  # prefetched
    assert store.stats.prefetched_chunks == 4 and store.stats.prefetch_late == 0
    for i in range(3):
        got = [t.token_id for o in outs[f"t{i}"] for t in o.tokens]
        assert got == reference[i]["tokens"]
        for x, y in zip(core.captured_logits[f"t{i}"], reference[i]["logits"], strict=True):
            assert torch.equal(x, y)


def test_forward_copies_a_layer_itself_when_the_loader_has_not_started(tiny):
    """A loader thread that has not got a core yet: the waiting forward copies the layers it
    needs itself (each exactly once), the loader then does the rest, and the references are
    handed back once, after every copy has stopped."""
    pool = KVBlockPool(tiny.num_layers, 16, 64, tiny.num_kv_heads, tiny.head_dim, tiny.dtype)
    kv = pool.reserve(512)
    objs = fake_chunks(tiny, 2, seed=9)
    inner = layerwise.chunk_copier(objs, kv, 256)
    copies: list[tuple[int, str]] = []

    def copy(layer: int) -> None:
        copies.append((layer, threading.current_thread().name))
        inner(layer)

    copy.helpable = True  # type: ignore[attr-defined]
    gate, exits = threading.Event(), []

    class HeldLoad(layerwise.LayerLoad):
        def _run(self) -> None:  # the loader thread waits for a core (here: for the gate)
            assert gate.wait(60)
            super()._run()

    load = HeldLoad(tiny.num_layers, copy, on_exit=lambda: exits.append(1))
    load.wait(0)
    load.wait(1)
    assert load.helped_layers == [0, 1] and not exits
    gate.set()
    for layer in range(2, tiny.num_layers):
        load.wait(layer)
    load.join(60)
    assert exits == [1] and load.done()
    assert sorted(layer for layer, _ in copies) == list(range(tiny.num_layers))  # once each
    assert [name for layer, name in copies if layer < 2] == [threading.current_thread().name] * 2
    assert_holds_chunks(kv, objs, tiny)


def test_a_failing_helped_copy_fails_the_load_and_still_exits_once(tiny):
    gate, exits = threading.Event(), []

    def copy(layer: int) -> None:
        if layer == 0:
            raise OSError("simulated copy failure")

    copy.helpable = True  # type: ignore[attr-defined]

    class HeldLoad(layerwise.LayerLoad):
        def _run(self) -> None:
            assert gate.wait(60)
            super()._run()

    load = HeldLoad(tiny.num_layers, copy, on_exit=lambda: exits.append(1))
    with pytest.raises(layerwise.LoadFailed):
        load.wait(0)
    gate.set()
    with pytest.raises(layerwise.LoadFailed):
        load.wait(tiny.num_layers - 1)  # never copied, released as failed
    load.join(60)
    assert exits == [1] and load.done()
