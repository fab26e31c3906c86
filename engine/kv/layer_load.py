"""``LayerLoad``: copy a KV load layer by layer on a thread while the forward pass runs.

The loader the reference engine's layer-wise load (``layerwise``) and the vLLM-CPU pods'
(``engine.vllm.paged_cpu``) share: layer ``i``'s copy runs on a thread, layer 0 first, and the
forward pass waits for the one layer it is about to read (``wait(i)``), or copies it itself when
the copy is ``helpable`` and the thread has not claimed it yet. No torch, no engine import: a
vLLM worker process imports it as it is.

A failed copy sets every event and re-raises in the waiting forward (``LoadFailed``);
``on_exit`` runs once, after every copy has stopped, whichever thread ran it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class LoadFailed(RuntimeError):
    """A layer-wise load did not complete: the request must be recomputed."""


class LayerLoad:
    """Runs ``copy_layer(i)`` for i = 0..L-1 on a thread; ``wait(i)`` blocks until layer i is in
    (or, for a ``helpable`` copy the thread has not claimed yet, copies layer i itself)."""

    def __init__(self, num_layers: int, copy_layer: Callable[[int], None], *,
                 on_exit: Callable[[], None] | None = None,
                 on_wait: Callable[[LayerLoad, int, float], None] | None = None,
                 name: str = "kv-layer-load", background: bool = True,
                 on_thread_start: Callable[[], None] | None = None) -> None:
        self.num_layers = num_layers
        self._copy = copy_layer
        # run first on the loader thread only (never on a helping forward thread): e.g. the
        # thread's own CPU affinity
        self._on_thread_start = on_thread_start
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
            if self._thread is not None and self._on_thread_start is not None:
                try:
                    self._on_thread_start()
                except Exception:  # noqa: BLE001 - a tuning hook never fails the load
                    pass
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
