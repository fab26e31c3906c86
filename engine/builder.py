"""Constructors: settings -> model, KV store, engine core (one place, used by the engine
process and by tests that drive an engine in-process)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from agentserving.decode.handoff.source import HandoffRegistry
from agentserving.engine.core import EngineCore, HandoffSite
from agentserving.engine.kv.keys import ChunkKeys
from agentserving.engine.kv.paged import KVBlockPool
from agentserving.engine.kv.store import KVStore, KVStoreConfig
from agentserving.engine.model.loader import ModelBundle, load_model
from agentserving.engine.model.runner import ModelRunner
from agentserving.engine.scheduler.registry import make_policy
from agentserving.engine.settings import WorkerSettings


@dataclasses.dataclass
class EngineParts:
    bundle: ModelBundle
    runner: ModelRunner
    keys: ChunkKeys
    store: KVStore
    core: EngineCore
    handoff: Any

    def close(self) -> None:
        self.core.close()
        self.store.close()


def build_engine(settings: WorkerSettings, index: int = 0, *,
                 bundle: ModelBundle | None = None) -> EngineParts:
    if settings.torch_threads:
        torch.set_num_threads(settings.torch_threads)
    bundle = bundle or load_model(settings.model, seed=settings.seed,
                                  max_model_len=settings.max_model_len)
    runner = ModelRunner(bundle)
    lm_model_name = settings.model_name.replace("/", "-").replace("@", "-")
    keys = ChunkKeys(settings.hash_scheme, settings.chunk_size, lm_model_name, bundle.dtype)
    store = KVStore(KVStoreConfig(
        model_name=lm_model_name, num_layers=bundle.num_layers, num_kv_heads=bundle.num_kv_heads,
        head_dim=bundle.head_dim, dtype=bundle.dtype, chunk_size=settings.chunk_size,
        cpu_gib=settings.cpu_cache_gib, disk_dir=settings.engine_disk_dir(index),
        disk_gib=settings.disk_cache_gib, verify_cpu=settings.verify_cpu_checksums,
        instance_id=f"{settings.pod_name}-engine-{index}",
        prefetch_wait_s=settings.prefetch_wait_s, direct_io=settings.disk_io == "direct",
        pin_share=settings.pin_share), keys)
    pool = KVBlockPool.for_bytes(
        int(settings.kv_cache_gib * 1024**3), num_layers=bundle.num_layers,
        block_size=settings.kv_block_size, num_kv_heads=bundle.num_kv_heads,
        head_dim=bundle.head_dim, dtype=bundle.dtype)
    handoff = HandoffRegistry(settings.kv_transfer_timeout_s)
    site = HandoffSite(settings.public_host, settings.engine_memory_port(index),
                       f"{settings.pod_name}/engine-{index}")
    core = EngineCore(
        runner, store, keys, make_policy(settings.scheduler_policy,
                                         settings.prefill_chunk_tokens),
        chunk_size=settings.chunk_size, max_running=settings.max_running_requests,
        # a request can never hold more KV than the pool: that is this engine's context limit
        max_model_len=min(bundle.max_model_len, pool.num_blocks * pool.block_size),
        handoff=handoff, handoff_site=site,
        pull_timeout_s=settings.kv_pull_timeout_s, pool=pool,
        layerwise_load=settings.kv_layerwise_load)
    return EngineParts(bundle, runner, keys, store, core, handoff)
