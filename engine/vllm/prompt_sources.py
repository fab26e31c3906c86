"""Where a vLLM pod's prompt tokens came from, read from its own Prometheus counters.

vLLM counts every prompt token once as ``local_compute``, ``local_cache_hit`` (its own prefix
cache, the device tier) or ``external_kv_transfer`` (loaded through the KV connector: LMCache's
DRAM, disk or KV server), in ``vllm:prompt_tokens_by_source_total``. The difference of two
readings says what a pod did with the requests between them: what the tests and the vLLM
bench check a restore or a hand-off against.
"""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

COUNTER = "vllm:prompt_tokens_by_source_total"


def prompt_tokens_by_source(metrics_text: str) -> dict[str, float]:
    """source -> tokens, summed over a pod's engines and models."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name == COUNTER and "source" in sample.labels:
                source = sample.labels["source"]
                out[source] = out.get(source, 0.0) + sample.value
    return out
