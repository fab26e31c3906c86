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
chunks; the tokens of a chunk that vLLM's prefix cache already held (``vllm_cached_tokens``)
are counted once, as device.

The same two halves give each turn its own figures (``prompt_sources.turn_sources``): rank 0's
retrieves are recorded per request in a ``load_log.LoadLog`` as well, and
``SchedulerReuse`` keeps each request's prompt and device hit until it finishes, when the
records its worker sent (``loaded``) complete them (``finish``).

The tenant comes from ``request_configs``: ``salting.TENANT_KEY`` (the API server's middleware
copies ``x-agentserving-tenant`` there), else a digest of the tenant's salt.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from agentserving.engine.metrics import DEFAULT_MAX_TENANTS, ReuseMetrics

from .load_log import DISK_CLOCK, LoadLog, LoadRecord, LoadsMeta
from .prompt_sources import turn_sources
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
                   retrieved: Sequence[bool] | Any, skip: int = 0) -> dict[str, int]:
    """Tokens per tier that a retrieve returned: ``block_mapping`` is LMCache's backend ->
    [(key, start, end)], ``retrieved`` its returned mask (true where a token was loaded); the
    first ``skip`` tokens (vLLM's own prefix-cache hit) are not counted."""
    out: dict[str, int] = {}
    for backend, blocks in block_mapping.items():
        n = sum(int(sum(bool(x) for x in retrieved[max(start, skip):end]))
                for _, start, end in blocks)
        if n:
            tier = tier_of(backend)
            out[tier] = out.get(tier, 0) + n
    return out


def count_retrieves(engine: Any, metrics: ReuseMetrics, loads: LoadLog | None = None) -> None:
    """Count every ``engine.retrieve`` (an ``LMCacheEngine``) by tier and tenant (once), and
    record it per request in ``loads`` (tokens by tier, its time and disk-read time)."""
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
        DISK_CLOCK.start()
        t0 = time.perf_counter()
        try:
            ret = retrieve(tokens, mask, **kwargs)
        finally:
            load_s, disk_s = time.perf_counter() - t0, DISK_CLOCK.stop()
        by_tier = tokens_by_tier(mapping, ret.tolist() if hasattr(ret, "tolist") else ret,
                                 int(kwargs.get("vllm_cached_tokens") or 0)) if mapping else {}
        if by_tier:
            metrics.observe(tenant_of(metrics, configs), 0, by_tier)
        if loads is not None and kwargs.get("req_id") is not None:
            loads.record(str(kwargs["req_id"]), by_tier, load_s, disk_s)
        return ret

    engine.retrieve = counted
    engine._agentserving_reuse = True


class SchedulerReuse:
    """The scheduler process's half: prompt tokens and device-tier hits, once per request, kept
    with the worker's load records until the request finishes (its ``prompt_sources``)."""

    def __init__(self, metrics: ReuseMetrics, bound: int = 65536) -> None:
        self.metrics = metrics
        self.bound = bound
        self._looked: dict[str, tuple[int, int]] = {}  # request -> (prompt, device tokens)
        self._loads: dict[str, LoadRecord] = {}

    def first_look(self, request_id: str, prompt_tokens: int, device_tokens: int,
                   request_configs: Any) -> bool:
        """A request's first scheduling attempt is counted; later ones (the connector asked
        again while the request waited) are not. Returns whether this one was counted."""
        if request_id in self._looked:
            return False
        if len(self._looked) >= self.bound:  # finished requests are forgotten; this is a guard
            self._looked.clear()
            self._loads.clear()
        self._looked[request_id] = (int(prompt_tokens), int(device_tokens))
        self.metrics.observe(tenant_of(self.metrics, request_configs), prompt_tokens,
                             {"device": device_tokens})
        return True

    def loaded(self, meta: LoadsMeta) -> None:
        """A step's load records, from the worker (``load_log``)."""
        for request_id, rec in meta.loads.items():
            if request_id in self._looked:
                old = self._loads.get(request_id)
                self._loads[request_id] = old.merge(rec) if old else rec

    def finish(self, request_id: str) -> dict[str, Any] | None:
        """The finished request's ``prompt_sources`` (None if it was never looked up here);
        forgotten after."""
        looked = self._looked.pop(request_id, None)
        rec = self._loads.pop(request_id, None) or LoadRecord()
        if looked is None:
            return None
        return turn_sources(looked[0], looked[1], rec.tokens, rec.load_s, rec.disk_read_s,
                            rec.failed)
