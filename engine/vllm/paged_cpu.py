"""LMCache's view of vLLM-CPU's paged KV: the CPU ``GPUConnectorInterface`` LMCache lacks.

LMCache 0.5.6 builds its engine-side connector with ``CreateGPUConnector``, which knows CUDA,
XPU, MUSA and HPU and raises "No supported cpu connector found" on vLLM-CPU, after which LMCache
runs degraded (every lookup recomputes). ``install()`` wraps that factory so a vLLM engine on
the CPU gets ``VLLMCPUPagedConnector`` and every other case gets LMCache's own answer. Our vLLM
connector module (``connector.py``) calls it at import, which vLLM does in every process that
builds a connector.

vLLM-CPU's attention backend keeps one tensor per layer, ``[blocks, kv_heads, block_size,
2 * head_size]``, read as ``[blocks, kv_heads, 2, block_size, head_size]``: per (block, head)
the block's K rows, then its V rows (``cpu_attn.py``: ``view(blocks, heads, 2 * block_size,
-1).chunk(2, dim=2)``). LMCache's memory objects are ``KV_2LTD``: ``[2, layers, tokens,
kv_heads * head_size]``. A token's slot (``slot_mapping``, absolute over the whole sequence, as
LMCache passes it) is ``block * block_size + offset``.

Exercised for real: a ``vllm serve`` on vllm-cpu 0.32.0 storing to and retrieving from
LMCache's CPU and disk tiers through this class, with greedy tokens and logprobs identical to a
recompute (engine/vllm/tests/test_vllm_serve.py).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import torch

from agentserving.core.logging import get_logger

log = get_logger(__name__)


def _base() -> type:
    from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface

    return GPUConnectorInterface


class VLLMCPUPagedConnector(_base()):  # type: ignore[misc]
    def __init__(self, num_layers: int, num_kv_heads: int, head_size: int) -> None:
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.kvcaches: list[torch.Tensor] | None = None

    @classmethod
    def from_metadata(cls, metadata: Any) -> VLLMCPUPagedConnector:
        # kv_shape: (layers, 2, chunk_size, kv_heads, head_size)
        layers, _, _, heads, head_size = (int(d) for d in metadata.kv_shape)
        return cls(layers, heads, head_size)

    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size([2, self.num_layers, num_tokens, self.num_kv_heads * self.head_size])

    def _layers(self, kwargs: dict[str, Any]) -> list[torch.Tensor]:
        self.initialize_kvcaches_ptr(**kwargs)
        if self.kvcaches is None:
            raise ValueError("kvcaches must be passed (or registered) before a transfer")
        return list(self.kvcaches)

    def _pages(self, kwargs: dict[str, Any], start: int, end: int
               ) -> Iterator[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]]:
        """(layer index, the layer as ``[blocks, heads, 2, block_size, head_size]``, block ids,
        offsets in the block) for the tokens [start, end) of every layer."""
        slot_mapping = kwargs.get("slot_mapping")
        if slot_mapping is None:
            raise ValueError("'slot_mapping' must be passed for a paged transfer")
        slots = slot_mapping[start:end].to("cpu", torch.long)
        for idx, layer in enumerate(self._layers(kwargs)):
            blocks, heads, block_size, width = layer.shape
            kv = layer.view(blocks, heads, 2, block_size, width // 2)
            yield idx, kv, slots // block_size, slots % block_size

    def _rows(self, memory_obj: Any, which: int, idx: int, n: int) -> torch.Tensor:
        """One layer's K (0) or V (1) rows of a ``KV_2LTD`` object, ``[n, heads, head_size]``."""
        return memory_obj.tensor[which, idx].view(n, self.num_kv_heads, self.head_size)

    # -- vLLM's cache -> memory object (store)
    def from_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
        for idx, kv, blocks, offsets in self._pages(kwargs, start, end):
            for which in (0, 1):  # K rows, then V rows
                self._rows(memory_obj, which, idx, end - start).copy_(
                    kv[blocks, :, which, offsets, :])

    def batched_from_gpu(self, memory_objs: Any, starts: list[int], ends: list[int],
                         **kwargs: Any) -> None:
        for obj, start, end in zip(memory_objs, starts, ends, strict=True):
            self.from_gpu(obj, start, end, **kwargs)

    # -- memory object -> vLLM's cache (retrieve)
    def to_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
        # tokens vLLM already holds may sit in blocks shared with other requests: leave them
        skip = min(end - start, max(0, int(kwargs.get("vllm_cached_tokens", 0)) - start))
        if skip == end - start:
            return
        for idx, kv, blocks, offsets in self._pages(kwargs, start + skip, end):
            for which in (0, 1):
                rows = self._rows(memory_obj, which, idx, end - start)[skip:]
                kv[blocks, :, which, offsets, :] = rows.to(kv.dtype)

    def batched_to_gpu(self, memory_objs: Any = None, starts: Any = None, ends: Any = None,
                       **kwargs: Any) -> None:
        for obj, start, end in zip(memory_objs, starts, ends, strict=True):
            self.to_gpu(obj, start, end, **kwargs)


def install() -> None:
    """Route ``CreateGPUConnector`` for vLLM on the CPU to ``VLLMCPUPagedConnector`` (once)."""
    import lmcache.v1.gpu_connector as factory
    from lmcache.utils import EngineType

    original = factory.CreateGPUConnector
    if getattr(original, "_agentserving_cpu", False):
        return

    @functools.wraps(original)
    def create(config: Any, metadata: Any, engine: Any, *args: Any, **kwargs: Any) -> Any:
        if engine == EngineType.VLLM and factory.torch_device_type == "cpu":
            if getattr(config, "use_layerwise", False):
                raise ValueError("lmcache use_layerwise is not supported on vLLM-CPU; "
                                 "set it to false")
            log.info("lmcache_cpu_connector", kv_shape=list(metadata.kv_shape))
            return VLLMCPUPagedConnector.from_metadata(metadata)
        return original(config, metadata, engine, *args, **kwargs)

    create._agentserving_cpu = True  # type: ignore[attr-defined]
    factory.CreateGPUConnector = create
