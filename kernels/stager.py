"""Double-buffered, layer-wise KV staging: layer i+1 stages while layer i is consumed.

    with LayerStager(k, v, block_table, tokens=n) as stager:
        for layer, kv in stager:          # kv: [2, tokens, heads, dim] (K = kv[0], V = kv[1])
            hidden = model.layers[layer](hidden, kv)

Contract:
- Two staging slots; layer i lives in slot ``i % 2``.
- ``get(i)`` returns layer i's buffer once it is staged, and before returning starts staging
  layer i+1 into the other slot. Calling ``get(i)`` therefore *releases* layer i-1: its buffer
  is overwritten next, so a consumer must be done with it (on CUDA: must have *enqueued* its
  work on the current stream; the staging stream waits for that point before overwriting).
- Layers are taken in order 0, 1, ..., layers-1 (``get`` of anything else raises).
- Overlap: on CUDA the gathers run on a side stream ordered by events; on the CPU on one worker
  thread (torch's copy kernels release the GIL). ``target`` (e.g. ``"cuda"``) stages from a
  host cache into device buffers: gather on the host into a pinned slot, then a non-blocking
  copy; the host slot is rewritten only once its previous copy has run (the CPU runs ahead of
  the device, and a DMA still queued would otherwise read the next layer's bytes). A table
  that is one contiguous run of blocks needs no gather: the copy reads the cache itself (one
  DMA for K, one for V; asynchronous when the cache is pinned, as LMCache's DRAM tier is).
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from types import TracebackType

import torch

from agentserving.kernels import dispatch, layout


class LayerStager:
    def __init__(self, k: torch.Tensor, v: torch.Tensor, block_table: torch.Tensor, *,
                 tokens: int | None = None, impl: str | None = None,
                 target: torch.device | str | None = None) -> None:
        if k.dim() != 5:
            raise ValueError(f"LayerStager needs [layers, blocks, block_size, heads, dim], "
                             f"got {tuple(k.shape)}")
        self.k, self.v = k, v
        self.table = block_table
        self.tokens = layout.check_tokens(block_table, k.shape[2], tokens)
        self.impl = impl
        self.num_layers = k.shape[0]
        self.target = torch.device(target) if target is not None else k.device
        shape = (2, self.tokens, *k.shape[3:])
        self.buffers = [torch.empty(shape, dtype=k.dtype, device=self.target) for _ in range(2)]
        self._host = None
        if self.target != k.device:
            pin = k.device.type == "cpu" and self.target.type == "cuda"
            self._host = [torch.empty(shape, dtype=k.dtype, pin_memory=pin) for _ in range(2)]
        self._cuda = k.device.type == "cuda" or self.target.type == "cuda"
        self._stream = torch.cuda.Stream(self.target) if self._cuda else None
        self._ready: list[object] = [None, None]      # Future (CPU) or Event (CUDA) per slot
        self._released: list[object] = [None, None]   # CUDA: consumer done with the slot
        self._copied: list[object] = [None, None]     # host slot -> device copy enqueued
        self._run = layout.contiguous_run(block_table) if self._host is not None else None
        self._pool = None if self._cuda else ThreadPoolExecutor(1, "kv-stager")
        self._next = 0        # the layer get() expects
        self.log: list[tuple[str, int]] = []  # ("stage", i) / ("get", i), in call order

    # -- staging
    def _gather(self, layer: int, slot: int) -> None:
        if self._host is None:
            dispatch.gather_blocks(self.k[layer], self.v[layer], self.table,
                                   tokens=self.tokens, out=self.buffers[slot], impl=self.impl)
            return
        if self._run is not None:  # contiguous blocks: DMA straight from the cache
            first, last = self._run, self._run + self.table.numel()
            for which, cache in enumerate((self.k[layer], self.v[layer])):
                rows = cache[first:last].flatten(0, 1)[: self.tokens]
                self.buffers[slot][which].copy_(rows, non_blocking=True)
            return
        if self._copied[slot] is not None:  # the slot's last DMA must have read it
            self._copied[slot].synchronize()
        dispatch.gather_blocks(self.k[layer], self.v[layer], self.table, tokens=self.tokens,
                               out=self._host[slot], impl=self.impl)
        self.buffers[slot].copy_(self._host[slot], non_blocking=True)
        if self._cuda:
            copied = torch.cuda.Event()
            copied.record(torch.cuda.current_stream(self.target))
            self._copied[slot] = copied

    def _stage(self, layer: int) -> None:
        slot = layer % 2
        self.log.append(("stage", layer))
        if self._cuda:
            with torch.cuda.stream(self._stream):
                if self._released[slot] is not None:
                    self._stream.wait_event(self._released[slot])
                self._gather(layer, slot)
                event = torch.cuda.Event()
                event.record(self._stream)
                self._ready[slot] = event
        else:
            self._ready[slot] = self._pool.submit(self._gather, layer, slot)

    def start(self) -> None:
        """Begin staging layer 0 (``get(0)`` does it if not yet done)."""
        if self._next == 0 and self._ready[0] is None:
            self._stage(0)

    def get(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s ``[2, tokens, heads, dim]`` buffer; starts staging ``layer + 1``."""
        if layer != self._next:
            raise ValueError(f"layers are taken in order: expected {self._next}, got {layer}")
        self.start()
        slot = layer % 2
        if layer > 0 and self._cuda:  # consumer has enqueued all its work on layer - 1
            released = torch.cuda.Event()
            released.record(torch.cuda.current_stream(self.target))
            self._released[1 - slot] = released
        if layer + 1 < self.num_layers:
            self._stage(layer + 1)
        ready = self._ready[slot]
        if isinstance(ready, Future):
            ready.result()
        else:
            torch.cuda.current_stream(self.target).wait_event(ready)
        self._ready[slot] = None
        self.log.append(("get", layer))
        self._next = layer + 1
        return self.buffers[slot]

    def __iter__(self) -> Iterator[tuple[int, torch.Tensor]]:
        for layer in range(self._next, self.num_layers):
            yield layer, self.get(layer)

    # -- lifetime
    def close(self) -> None:
        for ready in self._ready:
            if isinstance(ready, Future):
                ready.result()
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    def __enter__(self) -> LayerStager:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
