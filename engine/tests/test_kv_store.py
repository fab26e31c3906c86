"""The KV store on LMCache's real CPU and disk tiers: bit-exact round trips, checksums,
evict, prefetch with hot-cache registration and selective unpin, key interop."""

from __future__ import annotations

import os
import time

import pytest
import torch

from agentserving.core.hashing import ChunkHasher, HashScheme
from agentserving.core.schemas import Tier
from agentserving.engine.kv.keys import ChunkKeys
from agentserving.engine.model.runner import ModelRunner
from testkit.worker import prompt


def _fill(parts, tiny):
    """Store the 3 full chunks of a 900-token prompt on both tiers."""
    runner = ModelRunner(tiny)
    ids = prompt(900, seed=11)
    cache = runner.new_cache()
    runner.forward(ids[:768], cache, 0)
    runner.forward(ids[768:], cache, 768)
    layers = runner.cache_layers(cache)
    assert parts.store.store(ids, layers) == 3
    assert parts.store.wait_disk_writes()
    ints = parts.keys.int_hashes(ids)
    wire = [parts.keys.wire_of_int(v) for v in ints]
    return parts, ids, layers, ints, wire


@pytest.fixture
def filled(engine_factory, tiny):
    """An engine whose store holds the 3 full chunks of a 900-token prompt, on both tiers."""
    return _fill(engine_factory(), tiny)


def _same(layers, loaded, n):
    return all(torch.equal(k[:, :, :n], lk) and torch.equal(v[:, :, :n], lv)
               for (k, v), (lk, lv) in zip(layers, loaded, strict=True))


def _evict_cpu(parts, wire):
    parts.store.evict(wire, parts.store.resolve_locations(["cpu"]))


def _corrupt_on_disk(parts, wire, i: int, offset: int | None, mask: int) -> str:
    """Leave the chunks on disk alone (evicted from DRAM) and XOR one byte of chunk ``i``'s
    file (``offset`` None: its middle); that file's path."""
    _evict_cpu(parts, wire)
    path = parts.store.disk_path(wire[i])
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2 if offset is None else offset] ^= mask
    open(path, "wb").write(data)
    return path


def test_store_then_load_from_dram_and_from_disk_bit_exact(filled):
    parts, ids, layers, ints, wire = filled
    store = parts.store
    assert store.lookup(ints) == [Tier.CPU] * 3
    res = store.load_prefix(ints)
    assert res.num_tokens == 768 and res.tokens_by_tier == {Tier.CPU: 768}
    assert _same(layers, res.layers, 768)
    _evict_cpu(parts, wire)
    assert store.lookup(ints) == [Tier.DISK] * 3
    res = store.load_prefix(ints)
    assert res.num_tokens == 768 and res.tokens_by_tier == {Tier.DISK: 768}
    assert _same(layers, res.layers, 768)
    assert store.lookup(ints) == [Tier.CPU] * 3  # verified disk reads are written back
    files = {os.path.basename(store.disk_path(h)) for h in wire}
    assert files == set(os.listdir(store.config.disk_dir))


def test_direct_io_disk_reads_past_the_page_cache_are_bit_exact(engine_factory, tiny, tmp_path):
    from agentserving.engine.kv.disk_probe import direct_io_error

    if (why := direct_io_error(tmp_path)) is not None:
        pytest.skip(why)
    parts, ids, layers, ints, wire = _fill(engine_factory(disk_io="direct"), tiny)
    disk = parts.store.engine.storage_manager.storage_backends["LocalDiskBackend"]
    assert disk.use_odirect and all(os.path.getsize(parts.store.disk_path(h)) % disk.os_disk_bs
                                    == 0 for h in wire)  # else LMCache falls back to buffered
    _evict_cpu(parts, wire)
    res = parts.store.load_prefix(ints)
    assert res.num_tokens == 768 and res.tokens_by_tier == {Tier.DISK: 768}
    assert _same(layers, res.layers, 768)


def test_flipped_bit_on_disk_is_detected_and_never_served(filled):
    parts, ids, layers, ints, wire = filled
    store = parts.store
    path = _corrupt_on_disk(parts, wire, 1, None, 0x10)
    res = store.load_prefix(ints)
    assert res.corrupt == [wire[1]]
    assert res.num_tokens == 256 and _same(layers, res.layers, 256)
    assert store.lookup(ints) == [Tier.CPU]  # the bad chunk is gone from every tier
    assert store.disk_path(wire[1]) is None and not os.path.exists(path)
    assert store.stats.corrupt_chunks == 1


def test_truncated_and_missing_disk_files_are_detected(filled):
    parts, ids, layers, ints, wire = filled
    store = parts.store
    _evict_cpu(parts, wire)
    with open(store.disk_path(wire[2]), "r+b") as f:
        f.truncate(1000)
    res = store.load_prefix(ints)
    assert res.num_tokens == 512 and res.corrupt == [wire[2]]
    _evict_cpu(parts, wire)
    os.remove(store.disk_path(wire[0]))
    res = store.load_prefix(ints)
    assert res.num_tokens == 0 and res.layers is None and res.missing == [wire[0]]
    assert store.lookup(ints) == []


def test_evict_by_location_and_unknown_hashes_are_missing(filled):
    parts, ids, layers, ints, wire = filled
    store = parts.store
    unknown = ["ab" * 32, "-5f", "zz"]
    evicted, missing = store.evict(wire[:1] + unknown, store.resolve_locations(
        ["LocalCPUBackend"]))
    assert evicted == wire[:1] and missing == unknown
    assert store.tier_of(parts.keys.key(ints[0])) is Tier.DISK
    evicted, missing = store.evict(wire, store.backends)
    assert evicted == wire and missing == []
    assert store.lookup(ints) == [] and os.listdir(store.config.disk_dir) == []
    with pytest.raises(KeyError):
        store.resolve_locations(["RedisBackend"])


def _wait(status, timeout=10.0):
    deadline = time.monotonic() + timeout
    while status.state == "running" and time.monotonic() < deadline:
        time.sleep(0.01)
    return status


def test_prefetch_registers_in_dram_and_unpins_only_disk(filled):
    parts, ids, layers, ints, wire = filled
    store = parts.store
    _evict_cpu(parts, wire)
    status = store.prefetch(wire + ["cd" * 32], "look-1")
    assert (status.to_load, status.missing, status.in_cpu) == (3, 1, 0)
    _wait(status)
    assert status.state == "done" and status.loaded == 3
    assert store.prefetch_status("look-1") is status
    assert store.lookup(ints) == [Tier.CPU] * 3
    with store.disk.disk_lock:  # pins taken for the read were released on the disk backend
        assert all(meta.pin_count == 0 for meta in store.disk.dict.values())
    with store.cpu.cpu_lock:
        assert all(not store.cpu.hot_cache[parts.keys.key(v)].is_pinned for v in ints)
    for h in wire:  # the next load must not touch the disk at all
        os.remove(store.disk_path(h))
    res = store.load_prefix(ints)
    assert res.num_tokens == 768 and res.tokens_by_tier == {Tier.CPU: 768}
    assert _same(layers, res.layers, 768)


def test_prefetch_refuses_a_corrupt_chunk(filled):
    parts, ids, layers, ints, wire = filled
    _corrupt_on_disk(parts, wire, 0, 7, 0xFF)
    status = _wait(parts.store.prefetch(wire, None))
    assert status.state == "done" and status.corrupt == 1 and status.loaded == 2
    assert parts.store.tier_of(parts.keys.key(ints[0])) is None


def test_keys_round_trip_with_leading_zeros():
    keys = ChunkKeys(HashScheme.BLAKE3, 4, "tiny", torch.float32)
    value = 5  # a digest with 62 leading zero hex digits
    wire = keys.wire_of_int(value)
    assert len(wire) == 64 and keys.int_of(wire) == value
    assert keys.key_of("12") is None  # not a blake3 hash: never a key, so "missing"
    builtin = ChunkKeys(HashScheme.LMCACHE_BUILTIN, 4, "tiny", torch.float32)
    assert builtin.wire_of_int(-0x6ED9) == "-6ed9" and builtin.int_of("-6ed9") == -0x6ED9
    chain = ChunkHasher("blake3", 256).hashes(list(range(600)))
    assert [ChunkKeys(HashScheme.BLAKE3, 256, "m", torch.float32).wire_of_int(v) for v in
            ChunkKeys(HashScheme.BLAKE3, 256, "m", torch.float32).int_hashes(
                list(range(600)))] == chain


def test_builtin_scheme_keys_equal_stock_lmcache_keys(engine_factory):
    """With lmcache-builtin, our token database yields exactly stock LMCache's keys."""
    from lmcache.v1.token_database import ChunkedTokenDatabase

    parts = engine_factory(hash_scheme="lmcache-builtin")
    store = parts.store
    stock = ChunkedTokenDatabase(store._lm_config, store._metadata)
    tokens = list(range(600))
    ours = [k for _, _, k in store.engine.token_database.process_tokens(tokens)]
    theirs = [k for _, _, k in stock.process_tokens(tokens)]
    assert ours == theirs and len(ours) == 2
    assert [parts.keys.wire_of(k) for k in ours] == ["2b763dd00afa89c8", "79e62c807b48385b"]


def test_disk_reads_in_small_batches_still_bit_exact(filled, monkeypatch):
    from agentserving.engine.kv.store import KVStore

    monkeypatch.setattr(KVStore, "_disk_batch", property(lambda self: 1))
    parts, ids, layers, ints, wire = filled
    store = parts.store
    _evict_cpu(parts, wire)
    res = store.load_prefix(ints)
    assert res.num_tokens == 768 and _same(layers, res.layers, 768)
    _evict_cpu(parts, wire)
    status = _wait(store.prefetch(wire, None))
    assert status.loaded == 3 and store.lookup(ints) == [Tier.CPU] * 3


def test_fingerprints_survive_scans_during_a_store_and_go_with_the_chunk(engine_factory, tiny,
                                                                        monkeypatch):
    parts = engine_factory()
    store = parts.store
    original = store.connector.from_gpu

    def from_gpu_with_scans(obj, start, end, **kw):  # residency scans land mid-store
        original(obj, start, end, **kw)
        store.forget_digests(set())
        store.forget_digests(set())

    monkeypatch.setattr(store.connector, "from_gpu", from_gpu_with_scans)
    runner = ModelRunner(tiny)
    ids = prompt(600, seed=12)
    cache = runner.new_cache()
    runner.forward(ids[:512], cache, 0)
    runner.forward(ids[512:], cache, 512)
    assert store.store(ids, runner.cache_layers(cache)) == 2
    assert store.wait_disk_writes()
    ints = parts.keys.int_hashes(ids)
    assert all(store.expected_digest(v) is not None for v in ints)
    wire = [parts.keys.wire_of_int(v) for v in ints]
    _evict_cpu(parts, wire)
    assert store.load_prefix(ints).num_tokens == 512  # verifiable, so served from disk
    for v in ints:  # LMCache drops them by itself (its LRU), not through evict()
        for backend in (store.cpu, store.disk):
            backend.remove(parts.keys.key(v))
    resident = set().union(*store.residency().values())
    store.forget_digests(resident)
    assert store.expected_digest(ints[0]) is not None  # one scan is not enough
    store.forget_digests(resident)
    assert store.expected_digest(ints[0]) is None


@pytest.fixture
def small_disk(tmp_path):
    """A real filesystem with room for two and a half chunks of the tiny model (a tmpfs; root
    only): the kernel itself answers ENOSPC when it is full."""
    import subprocess

    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    path = tmp_path / "small-disk"
    path.mkdir()
    chunk = 2 * 4 * 256 * 4 * 64 * 4  # K and V, 4 layers, 256 tokens, 4 heads x 64, float32
    size_kib = (2 * chunk + chunk // 2) // 1024
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kib}k", "tmpfs", str(path)],
                      capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        yield path, chunk
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def test_a_full_disk_fails_the_write_cleanly_and_the_chunk_is_written_once_there_is_room(
        engine_factory, tiny, small_disk):
    """LMCache's disk writer, on ENOSPC, left the chunk's write "in flight" for ever (so no
    later store of that chunk ever reached the disk, and ``wait_disk_writes`` never returned),
    its half-written file on the disk (space no eviction would reclaim), its DRAM buffer
    referenced and its bytes counted as used. The store now undoes all of that."""
    disk, chunk = small_disk
    parts = engine_factory(disk_cache_dir=disk, disk_cache_gib=1.0)
    store = parts.store
    assert store.chunk_bytes == chunk
    runner = ModelRunner(tiny)
    ids = prompt(800, seed=5)
    cache = runner.new_cache()
    runner.forward(ids, cache, 0)
    layers = runner.cache_layers(cache)
    ints = parts.keys.int_hashes(ids)
    wire = [parts.keys.wire_of_int(v) for v in ints]
    # two chunks fill the disk, then the third finds no room: stored one after the other, since
    # LMCache's disk writers run concurrently and three writes at once may all run out of room
    assert store.store(ids[:512], layers) == 2
    assert store.wait_disk_writes(timeout_s=10)
    assert store.store(ids, layers, skip_chunks=2) == 1
    assert store.wait_disk_writes(timeout_s=10), "a failed write stayed in flight"
    on_disk = [w for w in wire if store.disk_path(w) is not None]
    assert len(on_disk) == 2 and store.stats.disk_write_errors == 1
    engine_dir = store.config.disk_dir
    assert sorted(os.listdir(engine_dir)) == sorted(os.path.basename(store.disk_path(w))
                                                   for w in on_disk), "a partial file is left"
    assert store.disk.current_cache_size == 2 * chunk  # the failed write is not counted
    # room again: the chunk that failed reaches the disk the next time it is stored (LMCache
    # stores a chunk no tier holds: this one once it has left DRAM too)
    store.evict(on_disk[:1], store.resolve_locations(["disk"]))
    missing = next(w for w in wire if w not in on_disk)
    store.evict([missing], store.resolve_locations(None))
    assert store.store(ids, layers, skip_chunks=wire.index(missing)) >= 1
    assert store.wait_disk_writes(timeout_s=10)
    assert store.disk_path(missing) is not None
    # and what is on disk reads back bit-exact
    _evict_cpu(parts, wire)
    i = wire.index(missing)
    res = store.load_prefix(ints[i:i + 1])
    assert res.num_tokens == 256 and not res.corrupt


def test_lmcache_statistics_bookkeeping_keeps_resident_chunks_only(filled):
    """LMCache's chunk first-seen times and request stats grew with every turn (a soak's
    decode worker); trimming keeps first-seen times of resident chunks and drains the rest."""
    from lmcache.observability import LMCStatsMonitor

    parts, ids, layers, ints, wire = filled
    store = parts.store
    policies = [b.cache_policy for b in (store.cpu, store.disk)]
    assert all(set(ints) <= set(p.chunk_hash_to_init_timestamp) for p in policies)
    monitor = LMCStatsMonitor.GetOrCreate()
    assert monitor.store_requests  # the store above left its request stats behind
    gone = max(ints) + 1
    for p in policies:
        p.chunk_hash_to_init_timestamp[gone] = 0.0  # a chunk evicted long ago
    resident = set().union(*store.residency().values())
    store.trim_lmcache_bookkeeping(resident)
    assert all(set(p.chunk_hash_to_init_timestamp) == set(ints) for p in policies)
    assert not monitor.store_requests
    assert store.lookup(ints) == [Tier.CPU] * 3  # statistics only: the chunks stay
    _evict_cpu(parts, wire)
    store.trim_lmcache_bookkeeping(set().union(*store.residency().values()))
    assert set(store.cpu.cache_policy.chunk_hash_to_init_timestamp) <= set(ints)
    assert set(store.disk.cache_policy.chunk_hash_to_init_timestamp) == set(ints)
