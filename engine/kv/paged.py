"""The reference engine's paged KV cache: preallocated blocks, one block table per request.

Why: transformers' ``DynamicCache`` grows every layer's K and V with ``torch.cat`` on every
forward pass, so each decoded token re-copies (and re-allocates) the whole context; and a
restored prefix had to be assembled into fresh tensors before the forward could start. Here
the KV lives in one pool allocated at start-up and is written in place:

- pool (``KVBlockPool``): K and V ``[layers, num_blocks, block_size, kv_heads, head_dim]``, the
  layout ``agentserving.kernels`` takes; a block allocator that prefers one consecutive run.
- request (``PagedKV``): its block table (tokens ``[i*bs, (i+1)*bs)`` live in block
  ``table[i]``), reserved for the whole timeline (prompt + output budget) at admission, and a
  reference count (a deferred store or a pinned hand-off keeps the blocks alive).
- model view (``PagedLayer``): what attention reads, ``[1, kv_heads, tokens, head_dim]``. When the
  request's blocks are one consecutive run it is a strided view of the pool (no copy: a decode
  step writes one token and reads in place); otherwise ``kernels.gather_blocks`` copies the
  blocks into a workspace (one launch per layer). Both have the same strides, and CPU SDPA
  results do not depend on them (tested: bit-identical to ``DynamicCache``).
- moving KV between LMCache chunks and the pool uses ``kernels.scatter_blocks`` /
  ``gather_blocks`` with the LMCache object as the staging buffer (``engine.kv.connector``).

A layer may have a pending ``source`` (a layer-wise load in flight, ``engine.kv.layerwise``):
its first ``update`` waits for that layer only, and the wait is recorded as exposed KV time.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from agentserving.kernels import dispatch


class PoolExhausted(RuntimeError):
    """More blocks were needed than the pool has free."""


class BlockAllocator:
    """Free blocks as sorted, disjoint ``[start, start + length)`` runs; first fit for one
    consecutive run, else any free blocks in id order."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._runs: list[list[int]] = [[0, num_blocks]] if num_blocks else []
        self.num_free = num_blocks

    def allocate(self, n: int) -> list[int] | None:
        if n <= 0:
            return []
        if n > self.num_free:
            return None
        for run in self._runs:
            if run[1] >= n:
                start = run[0]
                run[0] += n
                run[1] -= n
                self._runs = [r for r in self._runs if r[1]]
                self.num_free -= n
                return list(range(start, start + n))
        out: list[int] = []
        while len(out) < n:
            run = self._runs[0]
            take = min(run[1], n - len(out))
            out += range(run[0], run[0] + take)
            run[0] += take
            run[1] -= take
            if not run[1]:
                self._runs.pop(0)
        self.num_free -= n
        return out

    def extend_run(self, last: int, n: int) -> bool:
        """Take the ``n`` blocks right after ``last`` if free (a table stays consecutive)."""
        for run in self._runs:
            if run[0] == last + 1 and run[1] >= n:
                run[0] += n
                run[1] -= n
                self._runs = [r for r in self._runs if r[1]]
                self.num_free -= n
                return True
        return False

    def free(self, ids: list[int]) -> None:
        for b in sorted(ids):
            self._runs.append([b, 1])
        self.num_free += len(ids)
        self._runs.sort()
        merged: list[list[int]] = []
        for run in self._runs:
            if merged and merged[-1][0] + merged[-1][1] == run[0]:
                merged[-1][1] += run[1]
            else:
                merged.append(run)
        self._runs = merged


class KVBlockPool:
    """All KV of one engine: K and V ``[layers, num_blocks, block_size, kv_heads, head_dim]``.

    Allocated once with ``torch.empty`` (pages are committed as blocks are first written)."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: str | torch.device = "cpu",
                 impl: str | None = None) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"need blocks > 0 and block_size > 0, got {num_blocks}, "
                             f"{block_size}")
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.num_kv_heads, self.head_dim, self.dtype = num_kv_heads, head_dim, dtype
        self.impl = impl  # kernels implementation (None: by device)
        self.allocator = BlockAllocator(num_blocks)
        self._lock = threading.Lock()  # allocation/free (hand-off finalizers run anywhere)
        self._workspace: torch.Tensor | None = None
        self.stats = {"gathered_views": 0, "fragmented_tables": 0}

    @classmethod
    def for_bytes(cls, nbytes: int, *, num_layers: int, block_size: int, num_kv_heads: int,
                  head_dim: int, dtype: torch.dtype, **kw: Any) -> KVBlockPool:
        per_block = cls.block_bytes(num_layers, block_size, num_kv_heads, head_dim, dtype)
        return cls(num_layers, max(1, nbytes // per_block), block_size, num_kv_heads,
                   head_dim, dtype, **kw)

    @staticmethod
    def block_bytes(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                    dtype: torch.dtype) -> int:
        item = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * block_size * num_kv_heads * head_dim * item

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def can_hold(self, tokens: int) -> bool:
        return self.blocks_for(tokens) <= self.num_free_blocks

    def reserve(self, tokens: int) -> PagedKV | None:
        """A request's blocks for ``tokens`` tokens, or None if not free now."""
        with self._lock:
            ids = self.allocator.allocate(self.blocks_for(tokens))
        if ids is None:
            return None
        kv = PagedKV(self, ids)
        if not kv.consecutive:
            self.stats["fragmented_tables"] += 1
        return kv

    def _free(self, ids: list[int]) -> None:
        with self._lock:
            self.allocator.free(ids)

    def workspace(self, tokens: int) -> torch.Tensor:
        """``[2, >= tokens, heads, dim]``, shared: valid until the next layer asks for it."""
        ws = self._workspace
        if ws is None or ws.shape[1] < tokens:
            cap = max(tokens, 2 * ws.shape[1] if ws is not None else 0)
            ws = torch.empty(2, cap, self.num_kv_heads, self.head_dim, dtype=self.dtype,
                             device=self.k.device)
            self._workspace = ws
        return ws


class PagedKV:
    """One request's blocks in the pool: its block table and a reference count."""

    def __init__(self, pool: KVBlockPool, ids: list[int]) -> None:
        self.pool = pool
        self.ids = list(ids)
        self._refs = 1
        self._ref_lock = threading.Lock()
        self._update_table()

    def _update_table(self) -> None:
        self.table = torch.tensor(self.ids, dtype=torch.int64, device=self.pool.k.device)
        ids = self.ids
        self.consecutive = all(b == a + 1 for a, b in zip(ids, ids[1:], strict=False))

    @property
    def capacity(self) -> int:
        return len(self.ids) * self.pool.block_size

    # -- lifetime
    def retain(self) -> PagedKV:
        with self._ref_lock:
            if self._refs <= 0:
                raise RuntimeError("PagedKV used after release")
            self._refs += 1
        return self

    def release(self) -> None:
        with self._ref_lock:
            self._refs -= 1
            last = self._refs == 0
        if last:
            self.pool._free(self.ids)
            self.ids = []

    @property
    def alive(self) -> bool:
        return self._refs > 0

    def ensure(self, tokens: int) -> None:
        """Grow to hold ``tokens`` (keeps the table consecutive when the next blocks are free)."""
        need = self.pool.blocks_for(tokens) - len(self.ids)
        if need <= 0:
            return
        pool = self.pool
        with pool._lock:
            if self.ids and pool.allocator.extend_run(self.ids[-1], need):
                new = list(range(self.ids[-1] + 1, self.ids[-1] + 1 + need))
            else:
                new = pool.allocator.allocate(need)
        if new is None:
            raise PoolExhausted(f"KV pool has {pool.num_free_blocks} free blocks, a request "
                                f"needs {need} more")
        self.ids += new
        self._update_table()

    # -- addressing
    def chunk_table(self, start: int, end: int) -> torch.Tensor:
        """Block table of tokens ``[start, end)``; ``start`` must be block-aligned."""
        bs = self.pool.block_size
        if start % bs:
            raise ValueError(f"token {start} is not at a block boundary ({bs})")
        return self.table[start // bs: -(-end // bs)]

    def _flat(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Consecutive tables only: layer's K and V as ``[capacity, heads, dim]`` views."""
        pool, first = self.pool, self.ids[0]
        n = len(self.ids)
        shape = (n * pool.block_size, pool.num_kv_heads, pool.head_dim)
        return (pool.k[layer, first:first + n].view(shape),
                pool.v[layer, first:first + n].view(shape))

    def write(self, layer: int, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Put ``keys``/``values`` ``[1, heads, n, dim]`` at positions ``start..start+n``."""
        n = keys.shape[-2]
        self.ensure(start + n)
        k_src, v_src = keys[0].transpose(0, 1), values[0].transpose(0, 1)  # [n, heads, dim]
        if self.consecutive:
            fk, fv = self._flat(layer)
            fk[start:start + n].copy_(k_src)
            fv[start:start + n].copy_(v_src)
            return
        # A fragmented table: one index_copy_ per K and V (torch releases the GIL for it), not a
        # Python loop over blocks — this runs on a pull's copy thread beside the decode loop.
        pool = self.pool
        slots = self._slots(start, n)
        flat = (pool.k.shape[1] * pool.block_size, pool.num_kv_heads, pool.head_dim)
        pool.k[layer].view(flat).index_copy_(0, slots, k_src)
        pool.v[layer].view(flat).index_copy_(0, slots, v_src)

    def _slots(self, start: int, n: int) -> torch.Tensor:
        """Pool slot (block * block_size + offset) of positions ``start..start+n``."""
        bs = self.pool.block_size
        pos = torch.arange(start, start + n, device=self.table.device)
        return self.table[pos // bs] * bs + pos % bs

    def view(self, layer: int, tokens: int, *, copy: bool = False
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer's first ``tokens`` as ``[1, heads, tokens, dim]`` K and V: a view of the pool
        (consecutive table), else gathered by the kernel into the shared workspace — or, with
        ``copy``, into tensors of their own."""
        if self.consecutive and not copy:
            fk, fv = self._flat(layer)
            return (fk[:tokens].permute(1, 0, 2).unsqueeze(0),
                    fv[:tokens].permute(1, 0, 2).unsqueeze(0))
        pool = self.pool
        if copy:
            out = torch.empty(2, tokens, pool.num_kv_heads, pool.head_dim, dtype=pool.dtype,
                              device=pool.k.device)
        else:
            out = pool.workspace(tokens)[:, :tokens]
            pool.stats["gathered_views"] += 1
        table = self.table[: pool.blocks_for(tokens)]
        dispatch.gather_blocks(pool.k[layer], pool.v[layer], table, tokens=tokens, out=out,
                               impl=pool.impl)
        return out[0].permute(1, 0, 2).unsqueeze(0), out[1].permute(1, 0, 2).unsqueeze(0)

    def layers(self, tokens: int, *, copy: bool = False
               ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every layer's first ``tokens`` (own tensors for fragmented tables, or with copy)."""
        frag = not self.consecutive
        return [self.view(i, tokens, copy=copy or frag) for i in range(self.pool.num_layers)]


LayerSource = Callable[[int], float]  # layer -> seconds waited for it


def _layer_class() -> type:
    from transformers.cache_utils import DynamicLayer

    class PagedLayer(DynamicLayer):
        """One model layer's cache over a ``PagedKV``; ``length`` tokens are valid."""

        def __init__(self, kv: PagedKV, idx: int, length: int,
                     source: LayerSource | None) -> None:
            super().__init__()
            self.kv, self.idx, self.length, self.source = kv, idx, length, source
            self.dtype, self.device = kv.pool.dtype, kv.pool.k.device
            self.is_initialized = True
            self.waited = 0.0

        def materialize(self) -> None:
            """Wait for a pending load of this layer (recording the wait)."""
            if self.source is not None:
                source, self.source = self.source, None
                self.waited += source(self.idx)

        def update(self, key_states, value_states, *args, **kwargs):  # type: ignore[no-untyped-def]
            self.materialize()
            n = key_states.shape[-2]
            self.kv.write(self.idx, self.length, key_states, value_states)
            self.length += n
            self.keys, self.values = self.kv.view(self.idx, self.length)
            return self.keys, self.values

        def get_seq_length(self) -> int:
            return self.length

    return PagedLayer


_PAGED_LAYER: type | None = None


def paged_cache(config: Any, kv: PagedKV, length: int = 0,
                source: LayerSource | None = None) -> Any:
    """A transformers cache whose layers read and write ``kv``; ``length`` tokens are there
    already (or arriving: ``source(layer)`` is awaited before the layer is first used)."""
    global _PAGED_LAYER
    from transformers import DynamicCache

    if _PAGED_LAYER is None:
        _PAGED_LAYER = _layer_class()
    cache = DynamicCache(config=config)
    cache.layers = [_PAGED_LAYER(kv, i, length, source) for i in range(len(cache.layers))]
    cache.paged_kv = kv
    return cache


def is_paged(cache: Any) -> bool:
    return getattr(cache, "paged_kv", None) is not None


def exposed_seconds(cache: Any) -> float:
    """Seconds this cache's forward passes waited for layer loads so far."""
    return sum(getattr(layer, "waited", 0.0) for layer in cache.layers)


def all_materialized(cache: Any) -> bool:
    return all(getattr(layer, "source", None) is None for layer in cache.layers)
