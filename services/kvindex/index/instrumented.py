"""Wraps any Index or SessionStore with Prometheus metrics, so no backend carries them."""

from __future__ import annotations

import functools
import inspect
import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram

from agentserving.kvindex.index.base import BackendUnavailable

_LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1)


class IndexMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.latency = Histogram("kvindex_backend_op_seconds", "Backend operation latency.",
                                 ["store", "op"], registry=registry, buckets=_LATENCY_BUCKETS)
        self.errors = Counter("kvindex_backend_op_errors_total", "Backend operation errors.",
                              ["store", "op", "error"], registry=registry)


class Instrumented:
    """Times every coroutine method of ``inner``; other attributes pass through."""

    def __init__(self, inner: Any, metrics: IndexMetrics, store: str) -> None:
        self._inner = inner
        self._metrics = metrics
        self._store = store

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if not inspect.iscoroutinefunction(attr):
            return attr
        latency = self._metrics.latency.labels(self._store, name)
        errors = self._metrics.errors

        @functools.wraps(attr)
        async def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return await attr(*args, **kwargs)
            except BackendUnavailable:
                errors.labels(self._store, name, "unavailable").inc()
                raise
            finally:
                latency.observe(time.perf_counter() - start)

        return timed
