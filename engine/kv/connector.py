"""LMCache's view of the reference engine's KV: a CPU ``GPUConnectorInterface``.

LMCache moves KV between the serving engine's cache and its ``MemoryObj``s through a
connector; the shipped ones assert CUDA and ``MockGPUConnector`` copies nothing. This one
copies between a transformers cache's per-layer tensors (``[1, kv_heads, tokens, head_dim]``,
keys and values) and LMCache's ``KV_2LTD`` memory objects (``[2, layers, tokens,
kv_heads*head_dim]``), and fingerprints every object it fills (``on_digest`` kwarg) so that the
store can later tell a good chunk from a corrupt one.

Call kwargs (LMCache passes them through ``store``):
- ``layers``: list of (keys, values) per layer, source on store / destination on retrieve;
- or ``paged``: an ``engine.kv.paged.PagedKV`` (the engine's paged cache): one chunk moves in
  one ``kernels.gather_blocks`` / ``scatter_blocks`` launch for all layers, the memory object
  viewed as the kernels' staging buffer ``[layers, 2, tokens, heads, dim]`` (no extra copy).
- ``on_digest``: called as ``on_digest(start, digest, nbytes)`` for every object filled on store,
  before LMCache hands the object to any tier.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import blake3
import torch

from agentserving.kernels import dispatch

DIGEST_BYTES = 16


def digest(buf: Any) -> bytes:
    """The checksum of one chunk's bytes (blake3, 128 bits)."""
    view = memoryview(buf)
    if view.format != "B":  # LMCache's byte_array is a ctypes '<B' view
        view = view.cast("B")
    return blake3.blake3(view).digest(length=DIGEST_BYTES)


def _base() -> type:
    from lmcache.v1.gpu_connector import GPUConnectorInterface

    return GPUConnectorInterface


class CPUKVConnector(_base()):  # type: ignore[misc]
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int) -> None:
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.kvcaches = None

    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size([2, self.num_layers, num_tokens, self.num_kv_heads * self.head_dim])

    def staging(self, memory_obj: Any, n: int) -> torch.Tensor:
        """A ``KV_2LTD`` object as the kernels' staging layout ``[layers, 2, n, heads, dim]``."""
        return memory_obj.tensor.view(2, self.num_layers, n, self.num_kv_heads,
                                      self.head_dim).transpose(0, 1)

    # -- engine cache -> memory object (store)
    def from_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
        dst = memory_obj.tensor
        n = end - start
        paged = kwargs.get("paged")
        layers: Sequence[tuple[torch.Tensor, torch.Tensor]] = () if paged else kwargs["layers"]
        if paged is not None:
            pool = paged.pool
            dispatch.gather_blocks(pool.k, pool.v, paged.chunk_table(start, end), tokens=n,
                                   out=self.staging(memory_obj, n), impl=pool.impl)
        for idx, (k, v) in enumerate(layers):
            dst[0, idx].view(n, self.num_kv_heads, self.head_dim).copy_(
                k[0, :, start:end, :].transpose(0, 1))
            dst[1, idx].view(n, self.num_kv_heads, self.head_dim).copy_(
                v[0, :, start:end, :].transpose(0, 1))
        on_digest = kwargs.get("on_digest")
        if on_digest is not None:
            buf = memory_obj.byte_array
            on_digest(start, digest(buf), len(buf))

    def batched_from_gpu(self, memory_objs: Any, starts: list[int], ends: list[int],
                         **kwargs: Any) -> None:
        for obj, start, end in zip(memory_objs, starts, ends, strict=True):
            self.from_gpu(obj, start, end, **kwargs)

    # -- memory object -> engine cache (retrieve)
    def to_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
        src = memory_obj.tensor
        n = end - start
        paged = kwargs.get("paged")
        if paged is not None:
            pool = paged.pool
            dispatch.scatter_blocks(self.staging(memory_obj, n), pool.k, pool.v,
                                    paged.chunk_table(start, end), tokens=n, impl=pool.impl,
                                    unique=True)
            return
        layers: Sequence[tuple[torch.Tensor, torch.Tensor]] = kwargs["layers"]
        for idx, (k, v) in enumerate(layers):
            k[0, :, start:end, :].copy_(
                src[0, idx].view(n, self.num_kv_heads, self.head_dim).transpose(0, 1))
            v[0, :, start:end, :].copy_(
                src[1, idx].view(n, self.num_kv_heads, self.head_dim).transpose(0, 1))

    def batched_to_gpu(self, memory_objs: Any = None, starts: Any = None, ends: Any = None,
                       **kwargs: Any) -> None:
        for obj, start, end in zip(memory_objs, starts, ends, strict=True):
            self.to_gpu(obj, start, end, **kwargs)
