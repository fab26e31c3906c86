"""``VLLMCPUPagedConnector``'s layer-wise retrieve against a real LMCache engine (its CPU tier,
its memory objects and their reference counts): LMCache's ``retrieve`` only queues the copy,
``start_layer_load`` copies layer by layer on a thread, layer ``i`` is in vLLM's pages once
``wait_layer(i)`` returns, the tokens vLLM already holds are left alone, and the objects'
references go back once every layer is in, copied or failed."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from agentserving.engine.kv.layer_load import LoadFailed
from agentserving.engine.vllm.paged_cpu import VLLMCPUPagedConnector

LAYERS, HEADS, DIM, CHUNK = 4, 2, 8, 16
BLOCKS, BLOCK = 12, 8  # vLLM-CPU's cache: [blocks, heads, block_size, 2 * head_size] a layer
SENTINEL = 7.0


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[tuple[Any, VLLMCPUPagedConnector]]:
    from lmcache.v1.cache_engine import LMCacheEngine
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.token_database import ChunkedTokenDatabase

    config = LMCacheEngineConfig.from_dict({
        "chunk_size": CHUNK, "local_cpu": True, "max_local_cpu_size": 0.02,
        "save_unfull_chunk": False, "lmcache_instance_id": f"paged-{tmp_path.name}"})
    metadata = LMCacheMetadata(
        model_name="tiny-paged", world_size=1, local_world_size=1, worker_id=0,
        local_worker_id=0, kv_dtype=torch.float32, kv_shape=(LAYERS, 2, CHUNK, HEADS, DIM),
        chunk_size=CHUNK)
    paged = VLLMCPUPagedConnector.from_metadata(metadata)
    eng = LMCacheEngine(config, metadata, ChunkedTokenDatabase(config, metadata), paged,
                        lambda *a, **k: None, lambda *a, **k: None)
    eng.post_init()
    yield eng, paged
    paged.finish()
    eng.close()


def _cache(fill: float | None = None, seed: int = 0) -> list[torch.Tensor]:
    if fill is not None:
        return [torch.full((BLOCKS, HEADS, BLOCK, 2 * DIM), fill) for _ in range(LAYERS)]
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(BLOCKS, HEADS, BLOCK, 2 * DIM, generator=gen) for _ in range(LAYERS)]


def _slots(blocks: list[int]) -> torch.Tensor:
    """A request's slot mapping over the given (scattered) blocks, in token order."""
    return torch.tensor([b * BLOCK + i for b in blocks for i in range(BLOCK)])


def _kv_at(cache: list[torch.Tensor], layer: int, slots: torch.Tensor) -> torch.Tensor:
    """Layer ``layer``'s K and V rows of the tokens at ``slots``: [tokens, heads, 2, dim]."""
    kv = cache[layer].view(BLOCKS, HEADS, 2, BLOCK, DIM)
    return kv[slots // BLOCK, :, :, slots % BLOCK, :]


def _retrieve(eng: Any, paged: VLLMCPUPagedConnector, tokens: list[int], cache: Any,
              slots: torch.Tensor, vllm_cached: int = 0) -> int:
    paged.kvcaches = None
    mask = torch.ones(len(tokens), dtype=torch.bool)
    got = eng.retrieve(torch.tensor(tokens), mask, kvcaches=cache, slot_mapping=slots,
                       vllm_cached_tokens=vllm_cached)
    return int(got.sum())


def _queue_stored(eng: Any, paged: VLLMCPUPagedConnector, tokens: list[int],
                  source: Any, store_slots: torch.Tensor, dest: Any,
                  dest_slots: torch.Tensor) -> tuple[list[Any], list[int]]:
    """Store ``tokens`` from ``source``, then retrieve them layer-wise into ``dest`` (queued,
    not copied): the queued memory objects and their reference counts before the load."""
    paged.kvcaches = None
    eng.store(torch.tensor(tokens), kvcaches=source, slot_mapping=store_slots)
    paged.layerwise = True
    _retrieve(eng, paged, tokens, dest, dest_slots)
    objs = [w.obj for w in paged._pending]
    return objs, [o.get_ref_count() for o in objs]


def test_a_step_loads_layer_by_layer_behind_lmcaches_retrieve(engine) -> None:
    eng, paged = engine
    source = _cache(seed=1)
    # two requests of one step, 32 tokens each (two chunks), in scattered blocks
    a_tokens, b_tokens = list(range(100, 132)), list(range(500, 532))
    a_store, b_store = _slots([3, 0, 7, 5]), _slots([1, 9, 2, 11])
    for tokens, slots in ((a_tokens, a_store), (b_tokens, b_store)):
        paged.kvcaches = None
        eng.store(torch.tensor(tokens), kvcaches=source, slot_mapping=slots)
    # restored into other blocks; request a's first 4 tokens are vLLM's own already
    a_dst, b_dst = _slots([4, 6, 8, 10]), _slots([0, 1, 2, 3])
    whole = _cache(SENTINEL)
    paged.layerwise = False
    assert _retrieve(eng, paged, a_tokens, whole, a_dst, vllm_cached=4) == 32
    assert _retrieve(eng, paged, b_tokens, whole, b_dst) == 32

    paged.layerwise = True
    dest = _cache(SENTINEL)
    assert _retrieve(eng, paged, a_tokens, dest, a_dst, vllm_cached=4) == 32
    assert _retrieve(eng, paged, b_tokens, dest, b_dst) == 32
    # LMCache's retrieve returned: nothing copied yet, every object still referenced by us
    assert all(torch.all(layer == SENTINEL) for layer in dest)
    objs = [w.obj for w in paged._pending]
    assert len(objs) == 4 and paged.pending() == 4
    held = [o.get_ref_count() for o in objs]
    assert all(n >= 2 for n in held)  # the CPU tier's + ours

    load = paged.start_layer_load()
    assert load is not None and paged.pending() == 0
    for layer in range(LAYERS):
        assert paged.wait_layer(layer)
        # layer i is in as soon as wait(i) returns, both requests of the step
        assert torch.equal(_kv_at(dest, layer, a_dst[4:]), _kv_at(source, layer, a_store[4:]))
        assert torch.equal(_kv_at(dest, layer, b_dst), _kv_at(source, layer, b_store))
        # the 4 tokens vLLM held were not written
        assert torch.all(_kv_at(dest, layer, a_dst[:4]) == SENTINEL)
    assert paged.finish() is True  # the step's end: the load is over, its thread joined
    assert paged.finish() is False  # and forgotten
    assert [o.get_ref_count() for o in objs] == [n - 1 for n in held]
    # the same pages as the whole (synchronous) copy
    for lw, sync in zip(dest, whole, strict=True):
        assert torch.equal(lw, sync)
    assert paged.start_layer_load() is None  # nothing queued: no load


def test_finish_waits_for_every_layer_and_releases_the_objects(engine) -> None:
    eng, paged = engine
    source, tokens, slots = _cache(seed=2), list(range(7, 39)), _slots([2, 3, 4, 5])
    dest = _cache(0.0)
    objs, held = _queue_stored(eng, paged, tokens, source, slots, dest, _slots([8, 9, 10, 11]))
    paged.start_layer_load()
    assert paged.finish() is True  # without a single wait_layer: all of it in
    assert [o.get_ref_count() for o in objs] == [n - 1 for n in held]
    for layer in range(LAYERS):
        assert torch.equal(_kv_at(dest, layer, _slots([8, 9, 10, 11])),
                           _kv_at(source, layer, slots))
    assert paged.wait_layer(0) is False  # no load running


def test_a_failed_copy_raises_in_the_forward_and_still_releases(engine) -> None:
    """The connector catches the raise and reports ``load_blocks`` to vLLM as not loaded."""
    eng, paged = engine
    source, tokens, slots = _cache(seed=3), list(range(40, 72)), _slots([0, 1, 2, 3])
    outside = slots + BLOCKS * BLOCK  # slots past the cache: the copy itself fails
    objs, held = _queue_stored(eng, paged, tokens, source, slots, _cache(0.0), outside)
    paged.start_layer_load()
    assert paged.load_blocks == {int(b) for b in torch.unique(outside // BLOCK).tolist()}
    with pytest.raises(LoadFailed):
        paged.wait_layer(0)
    with pytest.raises(LoadFailed):
        paged.finish()
    assert [o.get_ref_count() for o in objs] == [n - 1 for n in held]


def test_the_loader_thread_leaves_the_forwards_core(monkeypatch) -> None:
    """vLLM-CPU binds the forward's thread to one core and a new thread inherits that: the
    loader widens its own binding to every CPU of the process, the forward's stays as it was."""
    import os
    import threading

    from agentserving.engine.vllm import paged_cpu

    allowed = os.sched_getaffinity(0)
    if len(allowed) < 2:
        pytest.skip("one CPU: nothing to widen")
    seen: dict[str, set[int]] = {}

    def loader() -> None:
        seen["inherited"] = os.sched_getaffinity(0)
        paged_cpu._unbind_thread()
        seen["loader"] = os.sched_getaffinity(0)

    first = min(allowed)
    os.sched_setaffinity(0, {first})  # as vLLM binds its forward thread
    try:
        t = threading.Thread(target=loader)
        t.start()
        t.join()
        assert os.sched_getaffinity(0) == {first}  # the forward's own binding untouched
    finally:
        os.sched_setaffinity(0, allowed)
    assert seen["inherited"] == {first} and seen["loader"] == allowed
    assert VLLMCPUPagedConnector(1, 1, 1)._thread_start is paged_cpu._unbind_thread
    monkeypatch.setenv(paged_cpu.LOADER_AFFINITY_ENV, "inherit")
    assert VLLMCPUPagedConnector(1, 1, 1)._thread_start is None
    monkeypatch.setenv(paged_cpu.LOADER_AFFINITY_ENV, "core0")
    with pytest.raises(ValueError, match=paged_cpu.LOADER_AFFINITY_ENV):
        VLLMCPUPagedConnector(1, 1, 1)
