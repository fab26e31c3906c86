"""Where a vLLM pod's prompt tokens came from: per pod, from its own Prometheus counters, and
per turn, in the answer's ``kv_transfer_params.prompt_sources``.

vLLM counts every prompt token once as ``local_compute``, ``local_cache_hit`` (its own prefix
cache, the device tier) or ``external_kv_transfer`` (loaded through the KV connector: LMCache's
DRAM, disk or KV server), in ``vllm:prompt_tokens_by_source_total``. The difference of two
readings says what a pod did with the requests between them: what the tests and the vLLM
bench check a restore or a hand-off against.

Per turn, the connector adds to each answer (``turn_sources``)::

    "prompt_sources": {"tokens": {"device": 512, "cpu": 3840, "disk": 1024, "remote": 0,
                                  "computed": 301},
                       "load_s": 0.041, "disk_read_s": 0.032, "fell_back": false}

``tokens`` adds up to the prompt: vLLM's prefix cache, LMCache's DRAM (``cpu``), disk and KV
server (``remote``: a P/D hand-off or a peer) tiers, and the rest, computed. ``load_s`` is the
time the request's retrieves held its step (synchronous: on the turn's critical path) and
``disk_read_s`` the part of it spent reading LMCache's disk tier. ``fell_back``: a load failed
and vLLM recomputed from its first block not loaded, so ``computed`` is a lower bound. The
worker's side of these figures travels to the scheduler in ``load_log``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

COUNTER = "vllm:prompt_tokens_by_source_total"
LOADED_TIERS = ("cpu", "disk", "remote")


def turn_sources(prompt_tokens: int, device_tokens: int, loaded: Mapping[str, int],
                 load_s: float = 0.0, disk_read_s: float = 0.0, fell_back: bool = False
                 ) -> dict[str, Any]:
    """One request's ``prompt_sources``: what the loads gave, beyond the device hit, and the
    rest computed (never below 0: a load may overlap the device hit by part of a chunk)."""
    tokens = {"device": int(device_tokens)}
    for tier in LOADED_TIERS:
        tokens[tier] = int(loaded.get(tier, 0))
    tokens["computed"] = max(0, int(prompt_tokens) - sum(tokens.values()))
    return {"tokens": tokens, "load_s": round(float(load_s), 6),
            "disk_read_s": round(float(disk_read_s), 6), "fell_back": bool(fell_back)}


def prompt_tokens_by_source(metrics_text: str) -> dict[str, float]:
    """source -> tokens, summed over a pod's engines and models."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name == COUNTER and "source" in sample.labels:
                source = sample.labels["source"]
                out[source] = out.get(source, 0.0) + sample.value
    return out
