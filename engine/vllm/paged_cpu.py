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

Layer-wise retrieve (``layerwise = True``, the connector's ``layerwise_load``): LMCache's
synchronous retrieve hands ``batched_to_gpu`` the request's memory objects and drops its own
references when it returns. In this mode ``batched_to_gpu`` copies nothing: it takes a
reference on each object (``ref_count_up``) and queues the copy; ``start_layer_load`` (the
connector calls it once ``start_load_kv`` has retrieved every request of the step) starts one
``layer_load.LayerLoad`` over all of them, layer 0 first, on a thread. The forward pass waits
for layer ``i`` only before layer ``i``'s attention (``wait_layer``; a layer the thread has not
started is copied by the forward thread itself), so the reload from LMCache's DRAM or disk tier
hides behind the layers before it. The references are dropped once every layer is in
(``on_exit``); ``finish`` waits for all of it and the connector calls it at the end of every
step, so a step never ends with a layer half written. The new tokens' KV vLLM writes during the
forward lands in other slots than the loaded ones. A layer's copy is two GIL-free ops however
many chunks it spans (the chunks' rows joined, then K and V in one ``index_put``): one op per
chunk would take the GIL back from the forward pass running beside it that many times. The
loader thread runs on any CPU of the pod (``AGENTSERVING_KV_LOADER_AFFINITY``), not on the core
vLLM bound the forward to. A step's objects stay referenced until its forward is over (LMCache
released each request's before the next one's retrieve): a DRAM tier full to the last chunk
may then have less room for a later request's disk reads within that step. A failed copy (a
memcpy on the CPU: not expected) surfaces as ``LoadFailed`` to the connector, which reports
the load's blocks (``load_blocks``) to vLLM as not loaded, so their requests are recomputed
(``fallbacks``); the failpoint ``layer_copy`` (``engine.failpoints``) makes one fail on a
test pod. LMCache's own
layer-wise mode (``use_layerwise``) stays refused: its retriever needs CUDA streams.

Exercised for real: a ``vllm serve`` on vllm-cpu 0.32.0 storing to and retrieving from
LMCache's CPU and disk tiers through this class, with greedy tokens and logprobs identical to a
recompute, layer-wise and whole (e2e/vllm/test_vllm_fleet.py); the deferred copy against real
LMCache memory objects (engine/vllm/tests/test_paged_cpu_layerwise.py); the reload time of both
modes (bench/vllm_layerwise_bench.py).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from agentserving.core.logging import get_logger
from agentserving.engine import failpoints
from agentserving.engine.kv.layer_load import LayerLoad

log = get_logger(__name__)


# The loader thread's CPUs: vLLM-CPU binds its OMP threads, the forward's thread included, one
# core each, and a thread inherits its creator's binding: left alone, the loader would share the
# forward thread's core. "all": every CPU the process may use (the kernel picks an idle one);
# "inherit": the creator's.
LOADER_AFFINITY_ENV = "AGENTSERVING_KV_LOADER_AFFINITY"


def loader_affinity() -> str:
    value = os.environ.get(LOADER_AFFINITY_ENV, "all")
    if value not in ("all", "inherit"):
        raise ValueError(f"{LOADER_AFFINITY_ENV}: expected 'all' or 'inherit', got {value!r}")
    return value


def _unbind_thread() -> None:
    """Let the calling thread run on any CPU of the process's cpuset (the kernel narrows the
    set to it)."""
    os.sched_setaffinity(0, range(os.cpu_count() or 1))


def _base() -> type:
    from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface

    return GPUConnectorInterface


@dataclass(frozen=True)
class _Deferred:
    """One memory object's retrieve, queued: its tokens vLLM does not hold yet (rows
    ``skip:n`` of the object) and where they go (``blocks``, ``offsets``) in ``layers``."""
    obj: Any
    skip: int
    n: int
    layers: list[torch.Tensor]
    blocks: torch.Tensor
    offsets: torch.Tensor


class VLLMCPUPagedConnector(_base()):  # type: ignore[misc]
    def __init__(self, num_layers: int, num_kv_heads: int, head_size: int,
                 layerwise: bool = False) -> None:
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.kvcaches: list[torch.Tensor] | None = None
        self.layerwise = layerwise
        self._thread_start = _unbind_thread if loader_affinity() == "all" else None
        self._pending: list[_Deferred] = []  # this step's retrieves, not copied yet
        self._load: LayerLoad | None = None  # the step's layer-wise copy
        self.load_blocks: set[int] = set()  # the vLLM blocks that copy fills

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
            if self.layerwise:
                self._defer(obj, start, end, kwargs)
            else:
                self.to_gpu(obj, start, end, **kwargs)

    # -- layer-wise retrieve: queued by batched_to_gpu, copied by a LayerLoad
    def _defer(self, memory_obj: Any, start: int, end: int, kwargs: dict[str, Any]) -> None:
        skip = min(end - start, max(0, int(kwargs.get("vllm_cached_tokens", 0)) - start))
        if skip == end - start:
            return
        slot_mapping = kwargs.get("slot_mapping")
        if slot_mapping is None:
            raise ValueError("'slot_mapping' must be passed for a paged transfer")
        layers = self._layers(kwargs)
        block_size = layers[0].shape[2]
        slots = slot_mapping[start + skip:end].to("cpu", torch.long)
        memory_obj.ref_count_up()  # LMCache drops its own reference when retrieve returns
        self._pending.append(_Deferred(memory_obj, skip, end - start, layers,
                                       slots // block_size, slots % block_size))

    def pending(self) -> int:
        """Memory objects queued for the next ``start_layer_load``."""
        return len(self._pending)

    def start_layer_load(self) -> LayerLoad | None:
        """Start copying what this step's retrieves queued (layer 0 first, on a thread); None
        when nothing was queued. A load still running from an earlier step is finished first."""
        self.finish()
        work, self._pending = self._pending, []
        self.load_blocks = set()
        if not work:
            return None
        self.load_blocks = {int(b) for w in work for b in torch.unique(w.blocks).tolist()}

        # one destination per set of layer tensors (a step's requests share vLLM's)
        groups: dict[int, list[_Deferred]] = {}
        for w in work:
            groups.setdefault(id(w.layers[0]), []).append(w)
        plans = [(ws, torch.cat([w.blocks for w in ws]), torch.cat([w.offsets for w in ws]))
                 for ws in groups.values()]
        heads, dim = self.num_kv_heads, self.head_size

        def copy_layer(i: int) -> None:
            # a fixed number of GIL-free ops per layer, however many chunks: the objects' rows
            # joined ([2, tokens, heads * dim]), then one index_put of K and V together. One op
            # per chunk would take the GIL back from the forward pass that many times per layer
            failpoints.hit("layer_copy")
            for ws, blocks, offsets in plans:
                rows = [w.obj.tensor[:, i, w.skip:w.n] for w in ws]
                src = rows[0] if len(rows) == 1 else torch.cat(rows, dim=1)
                nblocks, _, block_size, width = ws[0].layers[i].shape
                kv = ws[0].layers[i].view(nblocks, heads, 2, block_size, width // 2)
                # kv[blocks, :, :, offsets, :] is [tokens, heads, 2, dim]
                kv[blocks, :, :, offsets, :] = src.view(2, -1, heads, dim).permute(
                    1, 2, 0, 3).to(kv.dtype)

        copy_layer.helpable = True  # type: ignore[attr-defined]  # reads DRAM only

        def release() -> None:
            for w in work:
                w.obj.ref_count_down()

        self._load = LayerLoad(self.num_layers, copy_layer, on_exit=release,
                               name="vllm-kv-layer-load", on_thread_start=self._thread_start)
        return self._load

    def wait_layer(self, layer: int) -> bool:
        """Block until ``layer`` of the running load is in vLLM's pages (raises
        ``LoadFailed`` if a copy failed); False when no load runs."""
        if self._load is None:
            return False
        self._load.wait(layer)
        return True

    def finish(self) -> bool:
        """Wait for every layer of the running load, and its references' release; False when
        none ran. Raises ``LoadFailed`` if a copy failed."""
        load, self._load = self._load, None
        if load is None:
            return False
        try:
            for i in range(load.num_layers):
                load.wait(i)
        finally:
            load.join()  # on_exit (the references' release) has run
        return True


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
                                 "set it to false (the connector's layerwise_load setting "
                                 "loads layer by layer on the CPU)")
            log.info("lmcache_cpu_connector", kv_shape=list(metadata.kv_shape))
            return VLLMCPUPagedConnector.from_metadata(metadata)
        return original(config, metadata, engine, *args, **kwargs)

    create._agentserving_cpu = True  # type: ignore[attr-defined]
    factory.CreateGPUConnector = create
