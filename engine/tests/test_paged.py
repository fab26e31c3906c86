"""The paged KV cache: allocator, block tables, the model running over paged blocks bit for bit
like ``DynamicCache``, store/restore between LMCache chunks and blocks through the kernels,
and the layer-wise load that overlaps the forward pass (each layer waits for its own KV only),
with its recompute fallback."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from agentserving.engine.kv import layerwise
from agentserving.engine.kv.paged import BlockAllocator, KVBlockPool, PoolExhausted
from agentserving.engine.model.runner import ModelRunner
from testkit.worker import prompt, request, run


def _pool(tiny, blocks: int = 64, block_size: int = 64) -> KVBlockPool:
    return KVBlockPool(tiny.num_layers, blocks, block_size, tiny.num_kv_heads, tiny.head_dim,
                       tiny.dtype)


def _fragment(pool: KVBlockPool) -> None:
    """Leave every other block taken, so the next reservation cannot be consecutive."""
    taken = [pool.reserve(pool.block_size) for _ in range(pool.num_free_blocks)]
    for kv in taken[::2]:
        kv.release()


def test_allocator_prefers_one_run_and_merges_freed_blocks():
    a = BlockAllocator(10)
    x, y = a.allocate(3), a.allocate(3)
    assert x == [0, 1, 2] and y == [3, 4, 5]
    a.free(x)
    assert a.allocate(4) == [6, 7, 8, 9]  # first run long enough
    assert a.allocate(2) == [0, 1]
    assert a.allocate(3) is None and a.num_free == 1
    a.free(y)
    a.free([0, 1])
    assert a.allocate(6) == [0, 1, 2, 3, 4, 5]  # 0-1, 2 and 3-5 merged back into one run
    a.free([0, 1, 2, 3, 4, 5, 6, 7, 8, 9])
    a.allocate(2)
    assert a.extend_run(1, 3) and a.num_free == 5
    assert not a.extend_run(0, 1)  # block 1 is taken


def test_fragmented_allocation_and_growth(tiny):
    pool = _pool(tiny, blocks=8)
    _fragment(pool)
    kv = pool.reserve(3 * 64)
    assert kv is not None and not kv.consecutive and len(kv.ids) == 3
    kv.ensure(4 * 64)
    assert len(kv.ids) == 4
    with pytest.raises(PoolExhausted):
        kv.ensure(9 * 64)
    kv.release()
    assert pool.num_free_blocks == 4


@pytest.mark.parametrize("fragmented", [False, True])
def test_model_over_paged_blocks_is_bit_identical_to_dynamic_cache(tiny, fragmented):
    runner = ModelRunner(tiny)
    ids = prompt(700, seed=21)
    pool = _pool(tiny, blocks=40)
    if fragmented:
        _fragment(pool)
    kv = pool.reserve(720)
    assert kv.consecutive is not fragmented
    paged, dense = runner.paged_cache(kv), runner.new_cache()
    for cache in (paged, dense):  # chunk-split prefill, as the engine does it
        runner.forward(ids[:512], cache, 0)
    for start, end in ((512, 700),):
        a = runner.forward(ids[start:end], paged, start)
        b = runner.forward(ids[start:end], dense, start)
        assert torch.equal(a, b)
    tok = int(a.argmax())
    for i in range(12):  # decode: one token at a time, written in place
        a = runner.forward([tok], paged, 700 + i)
        b = runner.forward([tok], dense, 700 + i)
        assert torch.equal(a, b)
        tok = int(a.argmax())
    for (k1, v1), (k2, v2) in zip(runner.cache_layers(paged), runner.cache_layers(dense),
                                  strict=True):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)
    assert (pool.stats["gathered_views"] > 0) is fragmented  # the kernel fed attention


def test_store_and_restore_through_paged_blocks_equal_recompute(tiny, engine_factory):
    parts = engine_factory()
    store, runner = parts.store, parts.runner
    ids = prompt(768, seed=22)
    pool = _pool(tiny)
    kv = pool.reserve(768)
    cache = runner.paged_cache(kv)
    runner.forward(ids[:512], cache, 0)
    runner.forward(ids[512:], cache, 512)
    assert store.store(ids, None, paged=kv) == 3  # gathered from blocks by the kernel
    ints = store.keys.int_hashes(torch.tensor(ids), None)
    want = runner.cache_layers(cache)
    got = store.load_prefix(ints)
    assert got.num_tokens == 768
    for (k1, v1), (k2, v2) in zip(got.layers, want, strict=True):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)
    _fragment(pool)
    kv2 = pool.reserve(768)
    assert not kv2.consecutive
    fetched = store.fetch_prefix(ints, paged=kv2)  # scattered into blocks, all layers per launch
    assert fetched.num_tokens == 768 and fetched.objs == []
    for (k1, v1), (k2, v2) in zip(kv2.layers(768), want, strict=True):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)
    # layer by layer, on a thread, from the memory objects themselves
    kv3 = pool.reserve(768)
    fetched = store.fetch_prefix(ints)
    load = layerwise.LayerLoad(tiny.num_layers, layerwise.chunk_copier(fetched.objs, kv3, 256),
                               on_exit=fetched.release)
    for i in range(tiny.num_layers):
        load.wait(i)
    load.join()
    assert fetched.objs == []  # references handed back to LMCache
    for (k1, v1), (k2, v2) in zip(kv3.layers(768), want, strict=True):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)


def test_forward_waits_for_each_layer_only(tiny):
    """Layer i's attention starts while layers > i are still loading."""
    runner = ModelRunner(tiny)
    ids = prompt(300, seed=23)
    pool = _pool(tiny)
    src = runner.new_cache()
    runner.forward(ids[:256], src, 0)
    layers = runner.cache_layers(src)
    kv = pool.reserve(300)
    gates = [threading.Event() for _ in range(tiny.num_layers)]
    asked: list[int] = []

    def copy_layer(i: int) -> None:
        assert gates[i].wait(60)
        kv.write(i, 0, *layers[i])

    load = layerwise.LayerLoad(tiny.num_layers, copy_layer)

    def source(i: int) -> float:
        asked.append(i)
        return load.wait(i)

    cache = runner.paged_cache(kv, 256, source)
    out: list[torch.Tensor] = []
    fwd = threading.Thread(target=lambda: out.append(runner.forward(ids[256:], cache, 256)))
    fwd.start()
    for i in range(tiny.num_layers):
        deadline = time.monotonic() + 60
        while len(asked) < i + 1 and time.monotonic() < deadline:
            time.sleep(0.005)
        # the forward reached layer i while layers i..L-1 are not loaded yet
        assert asked == list(range(i + 1))
        assert not any(load._done[j].is_set() for j in range(i, tiny.num_layers))
        gates[i].set()
    fwd.join(60)
    assert torch.equal(out[0], runner.forward(ids[256:], src, 256))


def test_engine_layerwise_and_synchronous_loads_equal_recompute(engine_factory):
    ids = prompt(1100, seed=24)
    reference = run(engine_factory(), request("ref", ids))
    for layerwise_load in (True, False):
        parts = engine_factory(kv_layerwise_load=layerwise_load)
        parts.core.record_steps = True
        run(parts, request("cold", ids))
        warm = run(parts, request("warm", ids))
        assert warm["first"]["cached_tokens_by_tier"] == {"cpu": 1024}
        assert warm["tokens"] == reference["tokens"]
        for x, y in zip(warm["logits"], reference["logits"], strict=True):
            assert torch.equal(x, y)
        assert parts.core.stats.kv_load_seconds > 0
        assert all(r.forward_s > 0 for r in parts.core.step_records)
        for load in parts.core._loads:  # releases its hold on the blocks as it exits
            load.join(60)
        pool = parts.core.pool
        assert pool.num_free_blocks == pool.num_blocks  # every block came back


def test_failed_layer_load_falls_back_to_recompute(engine_factory, monkeypatch):
    ids = prompt(800, seed=25)
    reference = run(engine_factory(), request("ref", ids))
    parts = engine_factory()
    run(parts, request("cold", ids))

    def broken(objs, kv, size, **kw):
        def copy_layer(i: int) -> None:
            if i == 2:
                raise OSError("simulated copy failure")
        return copy_layer

    monkeypatch.setattr("agentserving.engine.core.chunk_copier", broken)
    got = run(parts, request("warm", ids))
    assert got["first"]["cached_tokens"] == 0  # recomputed, not served half-loaded
    assert got["tokens"] == reference["tokens"]
    for x, y in zip(got["logits"], reference["logits"], strict=True):
        assert torch.equal(x, y)


def test_requests_wait_for_free_blocks_and_oversized_ones_fail_clearly(engine_factory):
    parts = engine_factory(kv_cache_gib=8 / 1024)  # 16 blocks of 64 tokens (tiny model)
    core = parts.core
    assert core.pool.num_blocks == 16
    core.add(request("a", prompt(600, seed=26), max_tokens=4))   # 10 blocks
    core.add(request("b", prompt(500, seed=27), max_tokens=4))   # 8: waits for a's blocks
    core.add(request("big", prompt(1100, seed=28), max_tokens=4))  # 18 > 16: never fits
    done, errors = {}, {}
    while core.has_work():
        for o in core.step():
            if o.finished:
                (errors if o.error else done)[o.req_id] = o
        core.run_deferred()
    assert set(done) == {"a", "b"} and set(errors) == {"big"}
    assert "--kv-cache-gib" in errors["big"].error
    assert core.stats.kv_pool_full_waits > 0
    for load in core._loads:
        load.join(60)
    assert core.pool.num_free_blocks == 16


def test_queue_head_loads_while_the_step_before_it_runs(engine_factory):
    """On a busy engine the next request's prefix starts loading a step early; its output is
    still bit-identical to a recompute, and an abort gives its blocks back."""
    a_ids, b_ids, c_ids = prompt(600, seed=31), prompt(800, seed=32), prompt(700, seed=33)
    ref_b = run(engine_factory(), request("ref", b_ids + prompt(50, seed=34)))
    parts = engine_factory(max_running_requests=1)
    core = parts.core
    for name, ids in (("a", a_ids), ("b", b_ids), ("c", c_ids)):
        run(parts, request(name, ids, max_tokens=1))  # their prefixes are now cached
    core.add(request("a2", a_ids + prompt(50, seed=35), max_tokens=3))
    b2 = request("b2", b_ids + prompt(50, seed=34))
    c2 = request("c2", c_ids + prompt(50, seed=36))
    core.add(b2)
    core.add(c2)
    core.step()  # a2 admitted; b2 is next in line but no slot is free
    assert b2.prepared is None
    outs: dict[str, list] = {}
    prepared_seen = False
    while core.has_work():
        for o in core.step():
            outs.setdefault(o.req_id, []).append(o)
        prepared_seen = prepared_seen or (b2.prepared is not None and b2 in core.waiting)
        if "a2" in outs and outs["a2"][-1].finished and c2 in core.waiting and c2.prepared:
            core.abort("c2")  # a prepared request aborted in the queue
        core.run_deferred()
    assert prepared_seen  # its load started while a2 was still running
    got = [t.token_id for o in outs["b2"] for t in o.tokens]
    assert got == ref_b["tokens"] and outs["b2"][0].meta["cached_tokens"] == 768
    for x, y in zip(core.captured_logits["b2"], ref_b["logits"], strict=True):
        assert torch.equal(x, y)
    for load in core._loads:  # a copy still running keeps its blocks until it stops
        load.join(60)
    assert core.pool.num_free_blocks == core.pool.num_blocks


def test_write_into_a_fragmented_table_lands_at_every_position(tiny):
    """The fragmented path (one index_copy_ per K and V) puts each token where a view reads
    it, from an unaligned start across block boundaries, and touches nothing else."""
    pool = _pool(tiny, blocks=16, block_size=8)
    _fragment(pool)
    kv = pool.reserve(40)
    assert not kv.consecutive
    pool.k.zero_()
    pool.v.zero_()
    g = torch.Generator().manual_seed(5)
    shape = (1, tiny.num_kv_heads, 29, tiny.head_dim)
    keys = torch.randn(shape, generator=g).to(tiny.dtype)
    values = torch.randn(shape, generator=g).to(tiny.dtype)
    kv.write(1, 3, keys, values)
    k, v = kv.view(1, 40, copy=True)
    assert torch.equal(k[:, :, 3:32], keys) and torch.equal(v[:, :, 3:32], values)
    assert not k[:, :, :3].any() and not k[:, :, 32:].any() and not v[:, :, 32:].any()
    assert not pool.k[0].any() and not pool.k[2:].any()  # other layers untouched
