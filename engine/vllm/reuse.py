"""Prompt-token reuse by tier and tenant on a vLLM pod: the reference worker's
``agentserving_worker_prompt_tokens{tenant}`` and ``agentserving_worker_cached_tokens{tier,
tenant}`` (``engine.metrics.ReuseMetrics``), counted where a vLLM pod knows them.

- Scheduler process (``SchedulerReuse``, fed by the connector's
  ``get_num_new_matched_tokens``): each request's prompt tokens, and its ``device`` tier hit,
  the tokens vLLM's own prefix cache already holds (the scheduler hands the connector that
  count, block-aligned, at the request's first scheduling attempt; a request is counted once).
  Served on the pod's forwarding memory API, ``memory_port_start``'s ``/metrics``.
- Worker process, TP rank 0 only so that TP ranks are not counted k times
  (``count_retrieves``, wrapped around LMCache's ``retrieve``): the tokens each load took from
  LMCache's ``cpu`` (``LocalCPUBackend``), ``disk`` (``LocalDiskBackend``) or ``remote`` (the
  KV server a P/D hand-off goes through, any other backend) tier, as LMCache's own
  ``get_block_mapping`` assigns the chunks (prefix order, fastest backend first), capped to the
  tokens the retrieve really returned. Served on rank 0's memory API,
  ``memory_port_start + 1``'s ``/metrics``.

vLLM's own ``vllm:prompt_tokens_by_source_total{source}`` (``local_cache_hit`` = device,
``external_kv_transfer`` = all of LMCache) stays on vLLM's API port; it has no tenant and no
DRAM/disk split, which is what these add. Not counted: a layer-wise retrieve
(``use_layerwise``, off in AgentServing's pods: it bypasses ``retrieve``). LMCache loads whole
chunks, so a chunk that vLLM's prefix cache held in part is counted whole in its LMCache tier
as well (less than a chunk per request).

The tenant comes from ``request_configs``: ``salting.TENANT_KEY`` (the API server's middleware
copies ``x-agentserving-tenant`` there), else a digest of the tenant's salt.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

from agentserving.engine.metrics import DEFAULT_MAX_TENANTS, ReuseMetrics

from .salting import TENANT_KEY, salt_of

BACKEND_TIERS = {"LocalCPUBackend": "cpu", "LocalDiskBackend": "disk"}

_lock = threading.Lock()
_metrics: ReuseMetrics | None = None


def process_metrics(max_tenants: int = DEFAULT_MAX_TENANTS) -> ReuseMetrics:
    """This process's reuse counters, in the default registry (what the memory APIs serve);
    one per process, whatever number of connectors it builds."""
    global _metrics
    with _lock:
        if _metrics is None:
            _metrics = ReuseMetrics(None, max_tenants)
        return _metrics


def tenant_of(metrics: ReuseMetrics, request_configs: Any) -> str:
    """The tenant label of a request, from its LMCache ``request_configs``."""
    configs = request_configs if isinstance(request_configs, Mapping) else {}
    tenant = configs.get(TENANT_KEY)
    return metrics.tenants(tenant if isinstance(tenant, str) else None, salt_of(configs))


def tier_of(backend: str) -> str:
    return BACKEND_TIERS.get(backend, "remote")


def tokens_by_tier(block_mapping: Mapping[str, Sequence[tuple[Any, int, int]]],
                   retrieved: Sequence[bool] | Any) -> dict[str, int]:
    """Tokens per tier that a retrieve returned: ``block_mapping`` is LMCache's backend ->
    [(key, start, end)], ``retrieved`` its returned mask (true where a token was loaded)."""
    out: dict[str, int] = {}
    for backend, blocks in block_mapping.items():
        n = sum(int(sum(bool(x) for x in retrieved[start:end])) for _, start, end in blocks)
        if n:
            tier = tier_of(backend)
            out[tier] = out.get(tier, 0) + n
    return out


def count_retrieves(engine: Any, metrics: ReuseMetrics) -> None:
    """Count every ``engine.retrieve`` (an ``LMCacheEngine``) by tier and tenant (once)."""
    if getattr(engine, "_agentserving_reuse", False):
        return
    retrieve = engine.retrieve

    def counted(tokens: Any, mask: Any = None, **kwargs: Any) -> Any:
        try:
            configs = kwargs.get("request_configs")
            chunks = [(key, start, end) for start, end, key in engine.token_database
                      .process_tokens(tokens=tokens, mask=mask, request_configs=configs)]
            mapping = engine.storage_manager.get_block_mapping(chunks) if chunks else {}
        except Exception:  # noqa: BLE001 - the load goes on uncounted
            mapping, configs = {}, None
        ret = retrieve(tokens, mask, **kwargs)
        if mapping:
            by_tier = tokens_by_tier(mapping, ret.tolist() if hasattr(ret, "tolist") else ret)
            metrics.observe(tenant_of(metrics, configs), 0, by_tier)
        return ret

    engine.retrieve = counted
    engine._agentserving_reuse = True


class SchedulerReuse:
    """The scheduler process's half: prompt tokens and device-tier hits, once per request."""

    def __init__(self, metrics: ReuseMetrics, bound: int = 65536) -> None:
        self.metrics = metrics
        self.bound = bound
        self._seen: set[str] = set()

    def first_look(self, request_id: str, prompt_tokens: int, device_tokens: int,
                   request_configs: Any) -> bool:
        """A request's first scheduling attempt is counted; later ones (the connector asked
        again while the request waited) are not. Returns whether this one was counted."""
        if request_id in self._seen:
            return False
        if len(self._seen) >= self.bound:  # finished requests are forgotten; this is a guard
            self._seen.clear()
        self._seen.add(request_id)
        self.metrics.observe(tenant_of(self.metrics, request_configs), prompt_tokens,
                             {"device": device_tokens})
        return True

    def forget(self, request_id: str) -> None:
        self._seen.discard(request_id)
