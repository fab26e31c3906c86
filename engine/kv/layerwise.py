"""Layer-wise KV load, overlapped with the forward pass (seed 003 section 3).

On admission the engine knows which chunks of a request's prefix are cached and has them
verified (``KVStore.fetch_prefix``: LMCache memory objects, references held). Copying them
into the request's paged blocks is the bulk of the load; ``LayerLoad`` (``layer_load``, which
the vLLM-CPU pods' layer-wise retrieve shares) does it on a background thread, layer 0 first
(``chunk_copier``: two GIL-free ops per layer into one contiguous run of blocks, or one
``kernels.scatter_blocks`` launch per chunk for a fragmented table), with the LMCache object's
slice as the staging buffer. The forward pass starts at once: the paged
cache's layer ``i`` waits for ``done[i]`` only (``paged.PagedLayer.materialize``) while later
layers keep loading, so the load hides behind the compute of the layers before it. The time a
layer actually waits is the *exposed* KV time the benchmark reports
(``bench/kv_load_bench.py``).

The forward thread helps instead of idling: a ``helpable`` copy (``chunk_copier``'s, which
reads memory already in DRAM) of a layer the loader has not started yet is run by the thread
that needs it. On a busy host the loader thread may not get a core before the forward reaches
layer 0; the wait is then one layer's copy, never "until the scheduler runs the loader".

The same loader fills a decode pod's blocks from a P/D pull (``copy_layer`` waits for the
pulled layer and writes it; not helpable: the forward never blocks on the network), so a pull
and its local prefix never run on the step loop.

A failed copy sets every event and re-raises in the waiting forward (``LoadFailed``); the
engine then recomputes the request (correctness never depends on the load). ``on_exit`` runs
once, after every copy has stopped, whichever thread ran it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from agentserving.engine.kv.layer_load import LayerLoad, LoadFailed
from agentserving.engine.kv.paged import PagedKV
from agentserving.kernels import dispatch

__all__ = ["LayerLoad", "LoadFailed", "chunk_copier", "tensor_copier"]


def chunk_copier(objs: list[Any], kv: PagedKV, chunk_size: int, *, first_token: int = 0
                 ) -> Callable[[int], None]:
    """``copy_layer`` for LMCache ``KV_2LTD`` memory objects ``[2, L, chunk, heads*dim]`` (one
    per chunk, in order from ``first_token``): layer i of every chunk into ``kv``'s blocks.

    The usual table is one run of consecutive blocks: then a layer's prefix is one contiguous
    region of the pool and the copy is one ``torch.cat`` per K and V (two GIL-free ops per
    layer). Many small launches per layer (one per chunk) would each re-take the GIL from the
    forward pass running beside them, and the switch interval, not the bytes, would set the
    copy's pace. Fragmented tables go through ``kernels.scatter_blocks`` per chunk."""
    pool = kv.pool
    shape = (2, pool.num_layers, chunk_size, pool.num_kv_heads, pool.head_dim)
    staged = [obj.tensor.view(shape) for obj in objs]
    end = first_token + len(objs) * chunk_size
    if staged and kv.consecutive and first_token % pool.block_size == 0 \
            and end <= kv.capacity and staged[0].device == pool.k.device:

        # views of the run taken now: a later growth of the table cannot move them
        flats = [kv._flat(i) for i in range(pool.num_layers)]

        def copy_contiguous(layer: int) -> None:
            fk, fv = flats[layer]
            torch.cat([src[0, layer] for src in staged], out=fk[first_token:end])
            torch.cat([src[1, layer] for src in staged], out=fv[first_token:end])

        copy_contiguous.helpable = True  # type: ignore[attr-defined]
        return copy_contiguous
    tables = [kv.chunk_table(first_token + j * chunk_size, first_token + (j + 1) * chunk_size)
              for j in range(len(objs))]

    def copy_layer(layer: int) -> None:
        for src, table in zip(staged, tables, strict=True):
            dispatch.scatter_blocks(src[:, layer], pool.k[layer], pool.v[layer], table,
                                    tokens=chunk_size, impl=pool.impl, unique=True)

    copy_layer.helpable = True  # type: ignore[attr-defined]
    return copy_layer


def tensor_copier(get_layer: Callable[[int], tuple[Any, Any]], kv: PagedKV, *,
                  start: int = 0) -> Callable[[int], None]:
    """``copy_layer`` for per-layer ``[1, heads, tokens, dim]`` tensors (a P/D pull, whose
    ``layer(i)`` blocks until that layer has arrived)."""

    def copy_layer(layer: int) -> None:
        k, v = get_layer(layer)
        kv.write(layer, start, k, v)

    return copy_layer
