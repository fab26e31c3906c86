"""KV that could not be used, by cause: each one is a request recomputed, never one failed.

Seed 003's promise is that when an optimised path fails, the request falls back to computing
its prompt without hurting correctness. On vLLM that takes three parts: a tier read that fails
answers "not held" (``verified_disk``), LMCache then retrieves fewer tokens than it looked up
and records the blocks it could not fill, and vLLM's scheduler, with the connector's
``kv_load_failure_policy: recompute`` (``serve_command``), computes those blocks again instead
of failing the request (its default). The connector keeps such a step's newly computed KV out
of LMCache: it attended to blocks that were never filled (``connector``).

Every fallback is counted here (``agentserving_kv_fallbacks_total{cause}``, in the process
that met it: a worker's, on its memory API's ``/metrics``) and logged at warning once per cause
and process, then at debug: a disk going bad fails thousands of reads, and one line says so.
"""

from __future__ import annotations

import threading

from prometheus_client import Counter

from agentserving.core.logging import get_logger

log = get_logger(__name__)

CAUSES = ("disk_missing", "disk_truncated", "disk_corrupt", "disk_read_error",
          "load_incomplete", "layer_copy")
FALLBACKS = Counter("agentserving_kv_fallbacks_total",
                    "KV a request could not use and recomputed instead, by cause: a disk chunk "
                    "missing, truncated, corrupt (its checksum) or unreadable; a load that "
                    "retrieved fewer tokens than its lookup found (a DRAM object evicted "
                    "between them, a tier read that failed); a layer copy that failed.",
                    ["cause"])
for _cause in CAUSES:
    FALLBACKS.labels(_cause)

_logged: set[str] = set()
_lock = threading.Lock()


def fell_back(cause: str, **context: object) -> None:
    """Count one fallback of ``cause`` (one of ``CAUSES``) and say so, loudly the first time."""
    FALLBACKS.labels(cause).inc()
    with _lock:
        first = cause not in _logged
        _logged.add(cause)
    (log.warning if first else log.debug)("kv_fallback_recompute", cause=cause,
                                          first_of_cause=first, **context)
