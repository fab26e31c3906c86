"""How long each vLLM step waited for KV on its critical path, next to its forward pass.

Seed 003 measures a KV reload by what the forward pass still waits for, not by the copy itself:
a reload that overlaps the forward layer by layer costs nothing the request sees. vLLM calls
the connector at fixed points of every step in the worker process, and those points bound the
two figures:

- ``bind_connector_metadata``: the step starts (``StepClock.begin``);
- ``start_load_kv``: LMCache's retrieve; synchronous (not layer-wise) it returns only when the
  step's KV is in vLLM's pages, so all of it is on the critical path (``waited``);
- ``wait_for_layer_load(layer)``: layer-wise, what the forward still waits for before each
  layer's attention (``waited``, once per layer; ``layer_waited`` counts the layers that
  waited on a layer-wise load, so a summary tells layer-wise steps from whole ones);
- ``wait_for_save``: the forward is over (``end``); the KV stores that follow are the next
  figure's business, not the forward's.

``forward_s`` is the step's time minus what it waited for KV. A step that loads no KV (a
decode step, a prefill with nothing to reuse) is kept apart: the seed's figure is per step that
reloads. Pure bookkeeping with an injectable clock; the connector calls it, the worker's memory
API serves ``summary()`` at ``GET /memory/steps`` and Prometheus histograms at ``/metrics``.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class StepTime:
    kv_wait_s: float  # exposed: what the step waited for KV before or between its layers
    forward_s: float  # the step's time minus kv_wait_s
    loads: int  # requests whose KV this step loaded from LMCache's tiers
    layer_waits: int = 0  # layers that waited on a layer-wise load (0: whole or none)


class StepClock:
    """The connector's step boundaries -> ``StepTime``s (the last ``keep`` of them)."""

    def __init__(self, keep: int = 20000, clock: Callable[[], float] = time.perf_counter,
                 on_step: Callable[[StepTime], None] | None = None) -> None:
        self.clock = clock
        self.on_step = on_step
        self.steps: collections.deque[tuple[int, StepTime]] = collections.deque(maxlen=keep)
        self.count = 0  # steps ended so far (a step's number; ``summary(since=...)``)
        self._lock = threading.Lock()
        self._start: float | None = None
        self._waited = 0.0
        self._loads = 0
        self._layer_waits = 0

    def begin(self, loads: int = 0) -> None:
        self._start, self._waited, self._loads = self.clock(), 0.0, loads
        self._layer_waits = 0

    def waited(self, seconds: float) -> None:
        self._waited += max(0.0, seconds)

    def layer_waited(self) -> None:
        """One layer waited on a layer-wise load (its time goes through ``timed``)."""
        self._layer_waits += 1

    def timed(self) -> _Timed:
        """``with clock.timed(): ...`` adds the block's time to the step's KV wait."""
        return _Timed(self)

    def end(self) -> StepTime | None:
        if self._start is None:  # a save without a step (shutdown, a warm-up call)
            return None
        total = self.clock() - self._start
        step = StepTime(kv_wait_s=self._waited, forward_s=max(0.0, total - self._waited),
                        loads=self._loads, layer_waits=self._layer_waits)
        self._start = None
        with self._lock:
            self.count += 1
            self.steps.append((self.count, step))
        if self.on_step is not None:
            self.on_step(step)
        return step

    def summary(self, since: int = 0) -> dict[str, Any]:
        """The figures of the steps numbered after ``since`` (``last_step``: the newest number,
        what a caller passes next time to see only what came after), with the loading steps'
        samples ``[kv_wait_s, forward_s]`` so that several ranks or pods can be pooled."""
        with self._lock:
            steps = [st for n, st in self.steps if n > since]
            last = self.count
        return {**summarize(steps), "last_step": last,
                "loading": [[round(st.kv_wait_s, 6), round(st.forward_s, 6)]
                            for st in steps if st.loads]}


class _Timed:
    def __init__(self, clock: StepClock) -> None:
        self.clock = clock
        self.t0 = 0.0

    def __enter__(self) -> None:
        self.t0 = self.clock.clock()

    def __exit__(self, *exc: Any) -> None:
        self.clock.waited(self.clock.clock() - self.t0)


def loading_requests(metadata: Any) -> int:
    """Requests of a step whose KV LMCache loads (its connector metadata's load specs)."""
    return sum(1 for r in getattr(metadata, "requests", None) or ()
               if getattr(r, "load_spec", None) is not None and r.load_spec.can_load)


def percentile(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)), 6) if values else None


def summarize(steps: Iterable[StepTime]) -> dict[str, Any]:
    """P50/P95 of the KV wait and the forward over the steps that loaded KV (the seed's
    per-reload figure), their ratio at P50, and how many steps there were of each kind
    (``layerwise_steps``: loading steps whose KV came layer by layer)."""
    steps = list(steps)
    loading = [s for s in steps if s.loads > 0]
    wait = [s.kv_wait_s for s in loading]
    fwd = [s.forward_s for s in loading]
    out: dict[str, Any] = {"steps": len(steps), "loading_steps": len(loading),
                           "layerwise_steps": sum(1 for s in loading if s.layer_waits),
                           "kv_wait_exposed_p50_s": percentile(wait, 50),
                           "kv_wait_exposed_p95_s": percentile(wait, 95),
                           "forward_p50_s": percentile(fwd, 50),
                           "forward_p95_s": percentile(fwd, 95),
                           "kv_wait_total_s": round(sum(wait), 6)}
    p50w, p50f = out["kv_wait_exposed_p50_s"], out["forward_p50_s"]
    out["kv_wait_share_p50"] = (round(p50w / p50f, 4) if p50w is not None and p50f else None)
    return out


def pooled(summaries: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """The figures over several summaries' loading steps together (the pods of one fleet)."""
    summaries = [s for s in summaries if s]
    samples = [x for s in summaries if s for x in s.get("loading") or ()]
    steps = sum(int(s.get("steps") or 0) for s in summaries if s)
    out = summarize(StepTime(w, f, 1) for w, f in samples)
    layerwise = sum(int(s.get("layerwise_steps") or 0) for s in summaries if s)
    return {**out, "steps": steps, "layerwise_steps": layerwise}


def merge_summaries(parts: Iterable[dict[str, Any]]) -> dict[str, Any] | None:
    """One pod's figure from its ranks' summaries: the slowest rank's (TP ranks wait for each
    other, so the step takes as long as its slowest rank)."""
    parts = [p for p in parts if p]
    if not parts:
        return None
    return max(parts, key=lambda p: p.get("kv_wait_total_s") or 0.0)


def prometheus_observer(registry: Any = None) -> Callable[[StepTime], None]:
    """An ``on_step`` that feeds ``agentserving_vllm_step_kv_wait_seconds`` and
    ``agentserving_vllm_step_forward_seconds`` (label ``loads``: whether the step loaded KV),
    in the default registry the worker's ``/metrics`` serves."""
    from prometheus_client import REGISTRY, Histogram

    buckets = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
    reg = registry or REGISTRY
    wait = Histogram("agentserving_vllm_step_kv_wait_seconds", "KV wait on a vLLM step's "
                     "critical path (LMCache's retrieve, or layer-wise the waits between "
                     "layers)", ["loads"], buckets=buckets, registry=reg)
    forward = Histogram("agentserving_vllm_step_forward_seconds", "A vLLM step's time less "
                        "its KV wait", ["loads"], buckets=buckets, registry=reg)

    def observe(step: StepTime) -> None:
        label = "yes" if step.loads else "no"
        wait.labels(label).observe(step.kv_wait_s)
        forward.labels(label).observe(step.forward_s)

    return observe
