"""Real LMCache engines (stock ``ChunkedTokenDatabase``, ``LocalCPUBackend`` +
``LocalDiskBackend``) as a vLLM worker process holds them, minus vLLM: KV moves through a
small CPU connector over a ``[2, layers, tokens, hidden]`` tensor."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")

import torch  # noqa: E402

LAYERS, HEADS, DIM, CHUNK = 2, 2, 8, 16
MODEL = "tiny-vllm"


def _connector_class() -> type:
    from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface

    class TensorConnector(GPUConnectorInterface):  # type: ignore[misc]
        """``kv=`` (store) / ``out=`` (retrieve): a ``[2, layers, tokens, hidden]`` tensor."""

        def get_shape(self, num_tokens: int) -> torch.Size:
            return torch.Size([2, LAYERS, num_tokens, HEADS * DIM])

        def from_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
            memory_obj.tensor.copy_(kwargs["kv"][:, :, start:end])

        def to_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
            kwargs["out"][:, :, start:end].copy_(memory_obj.tensor)

        def batched_from_gpu(self, memory_objs, starts, ends, **kwargs):  # type: ignore[no-untyped-def]
            for obj, s, e in zip(memory_objs, starts, ends, strict=True):
                self.from_gpu(obj, s, e, **kwargs)

        def batched_to_gpu(self, memory_objs=None, starts=None, ends=None, **kwargs):  # type: ignore[no-untyped-def]
            for obj, s, e in zip(memory_objs or [], starts or [], ends or [], strict=True):
                self.to_gpu(obj, s, e, **kwargs)

    return TensorConnector


def build_engine(disk: Path, worker_id: int = 0, world_size: int = 1) -> Any:
    from lmcache.v1.cache_engine import LMCacheEngine
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.token_database import ChunkedTokenDatabase

    disk.mkdir(parents=True, exist_ok=True)
    config = LMCacheEngineConfig.from_dict({
        "chunk_size": CHUNK, "local_cpu": True, "max_local_cpu_size": 0.02,
        "local_disk": str(disk), "max_local_disk_size": 0.05, "save_unfull_chunk": False,
        "lmcache_instance_id": f"test-{worker_id}"})
    metadata = LMCacheMetadata(
        model_name=MODEL, world_size=world_size, local_world_size=world_size,
        worker_id=worker_id, local_worker_id=worker_id, kv_dtype=torch.float32,
        kv_shape=(LAYERS, 2, CHUNK, HEADS, DIM), chunk_size=CHUNK)
    engine = LMCacheEngine(config, metadata, ChunkedTokenDatabase(config, metadata),
                           _connector_class()(), lambda *a, **k: None, lambda *a, **k: None)
    engine.post_init()
    return engine


def random_kv(tokens: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(2, LAYERS, tokens, HEADS * DIM, generator=gen)


def until(check: Callable[[], Any], timeout_s: float = 20.0, what: str = "") -> Any:
    """Wait for an asynchronous effect (LMCache's disk writer, a poll round); never a timing
    assertion: the deadline only bounds a hang."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not reached within {timeout_s}s: {what}")
        time.sleep(0.05)


@pytest.fixture
def engines(tmp_path: Path) -> Iterator[Callable[..., Any]]:
    built: list[Any] = []

    def make(worker_id: int = 0, world_size: int = 1) -> Any:
        eng = build_engine(tmp_path / f"disk{worker_id}", worker_id, world_size)
        built.append(eng)
        return eng

    yield make
    for eng in built:
        try:
            eng.close()
        except Exception:  # noqa: BLE001 - best-effort teardown
            pass
