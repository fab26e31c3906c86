"""Layer-wise KV load, overlapped with the forward pass (seed 003 section 3).

On admission the engine knows which chunks of a request's prefix are cached and has them
verified (``KVStore.fetch_prefix``: LMCache memory objects, references held). Copying them
into the request's paged blocks is the bulk of the load; ``LayerLoad`` does it on a background
thread, layer 0 first (``chunk_copier``: two GIL-free ops per layer into one contiguous run of
blocks, or one ``kernels.scatter_blocks`` launch per chunk for a fragmented table), with the
LMCache object's slice as the staging buffer. The forward pass starts at once: the paged
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

import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from agentserving.engine.kv.paged import PagedKV
from agentserving.kernels import dispatch


class LoadFailed(RuntimeError):
    """A layer-wise load did not complete: the request must be recomputed."""


class LayerLoad:
    """Runs ``copy_layer(i)`` for i = 0..L-1 on a thread; ``wait(i)`` blocks until layer i is in
    (or, for a ``helpable`` copy the thread has not claimed yet, copies layer i itself)."""

    def __init__(self, num_layers: int, copy_layer: Callable[[int], None], *,
                 on_exit: Callable[[], None] | None = None,
                 on_wait: Callable[[LayerLoad, int, float], None] | None = None,
                 name: str = "kv-layer-load", background: bool = True) -> None:
        self.num_layers = num_layers
        self._copy = copy_layer
        self._helpable = bool(getattr(copy_layer, "helpable", False))
        self._on_exit = on_exit
        # (load, layer, seconds waited) after each successful wait; handed the load rather than
        # closing over it, so no reference cycle keeps a finished load (and the pulled frames
        # its copier reads) alive until a full garbage collection
        self._on_wait = on_wait
        self._done = [threading.Event() for _ in range(num_layers)]
        self._claimed = [False] * num_layers
        self._claim_lock = threading.Lock()
        self.error: BaseException | None = None
        self.started_at = time.perf_counter()
        self.layer_seconds: list[float] = [0.0] * num_layers  # copy time per layer
        self.helped_layers: list[int] = []  # copied by the waiting thread
        self.finished_at: float | None = None
        self.waited = 0.0
        if background:
            self._thread: threading.Thread | None = threading.Thread(
                target=self._run, name=name, daemon=True)
            self._thread.start()
        else:  # the non-overlapped baseline: everything before the forward
            self._thread = None
            self._run()

    def _claim(self, layer: int) -> bool:
        with self._claim_lock:
            if self._claimed[layer] or self.error is not None:
                return False
            self._claimed[layer] = True
            return True

    def _copy_one(self, layer: int) -> None:
        t0 = time.perf_counter()
        try:
            self._copy(layer)
        except BaseException as exc:  # noqa: BLE001 - surfaced to the waiting forward
            with self._claim_lock:
                self.error = self.error or exc
        finally:
            self.layer_seconds[layer] = time.perf_counter() - t0
            self._done[layer].set()

    def _run(self) -> None:
        try:
            for i in range(self.num_layers):
                if self.error is not None:
                    break
                if self._claim(i):
                    self._copy_one(i)
        finally:
            with self._claim_lock:  # nobody starts a copy from now on ...
                unclaimed = [i for i, c in enumerate(self._claimed) if not c]
                self._claimed = [True] * self.num_layers
            for i in unclaimed:  # (only after a failure) ... these never will run
                self._done[i].set()
            for ev in self._done:  # ... and a copy the forward thread runs is let finish
                ev.wait()
            self.finished_at = time.perf_counter()
            if self._on_exit is not None:
                self._on_exit()

    def wait(self, layer: int) -> float:
        """Block until ``layer`` is loaded; returns the seconds spent waiting (or copying)."""
        t0 = time.perf_counter()
        if self._helpable and not self._done[layer].is_set() and self._claim(layer):
            self.helped_layers.append(layer)
            self._copy_one(layer)
        self._done[layer].wait()
        waited = time.perf_counter() - t0
        self.waited += waited
        if self.error is not None:
            raise LoadFailed(f"layer-wise KV load failed: {self.error!r}") from self.error
        if self._on_wait is not None:
            self._on_wait(self, layer, waited)
        return waited

    def done(self) -> bool:
        return self.finished_at is not None

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def seconds(self) -> float:
        return (self.finished_at or time.perf_counter()) - self.started_at


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
