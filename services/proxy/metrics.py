"""The proxy's Prometheus metrics."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class ProxyMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.routed = Counter("proxy_routing_decisions_total", "Turns routed, by pod and stage.",
                              ["stage", "pod", "policy"], registry=registry)
        self.cached_tokens = Counter("proxy_cached_tokens_total",
                                     "Prompt tokens served from cache, by prefill pod.", ["pod"],
                                     registry=registry)
        self.prompt_tokens = Counter("proxy_prompt_tokens_total", "Prompt tokens, by prefill pod.",
                                     ["pod"], registry=registry)
        self.ttft = Histogram("proxy_ttft_seconds", "Time to first token seen by the caller.",
                              buckets=_LATENCY, registry=registry)
        self.e2e = Histogram("proxy_request_seconds", "End-to-end turn latency.",
                             buckets=_LATENCY, registry=registry)
        self.overhead = Histogram("proxy_routing_seconds",
                                  "Time spent deciding where a turn goes (incl. kvindex lookup).",
                                  buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01,
                                           0.05, 0.1, 0.5), registry=registry)
        self.lookups = Counter("proxy_kv_lookups_total",
                               "kv-aware lookups, by who answered: replica (the in-process "
                               "residency replica) or kvindex (a round trip: the replica is "
                               "off or stale).", ["source"], registry=registry)
        self.retries = Counter("proxy_retries_total", "Upstream attempts retried on another pod.",
                               ["stage"], registry=registry)
        self.failures = Counter("proxy_failed_turns_total", "Turns answered with an error.",
                                ["reason"], registry=registry)
        self.api_turns = Counter(
            "proxy_api_turns_total", "Turns by the API they came in by (chat, completions, "
            "messages, responses) and what named their session (session_identity: a header, "
            "prompt_cache_key, metadata.user_id, user, previous_response_id, response; none).",
            ["api", "session_source"], registry=registry)
        self.degraded = Counter("proxy_degraded_total",
                                "Turns routed without the kvindex (unreachable).",
                                registry=registry)
        self.memory_hooks = Counter("proxy_memory_hook_calls_total",
                                    "Session calls to the kvindex: each turn's context "
                                    "(context), agent_memory's and the hints' verbs.",
                                    ["op", "ok"], registry=registry)
        self.context_changes = Counter(
            "proxy_context_changes_total",
            "Turns whose prompt left the session's previous context before its end (history "
            "compacted or edited); with --context-change-evict the kvindex evicts the chunks "
            "only the dropped context held (kvindex_reclaimed_*{reason=\"context_change\"}).",
            registry=registry)
        self.shared_sessions = Counter(
            "proxy_shared_session_records_total",
            "--shared-sessions: records read before a turn (adopted: newer than this "
            "replica's; current; missing) or written after it (written), or failed.",
            ["op", "result"], registry=registry)
        self.tool_gap_error = Histogram("proxy_tool_gap_prediction_error_seconds",
                                        "|predicted - actual| tool-call gap.",
                                        buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30),
                                        registry=registry)
        self.tool_gap_warm = Counter("proxy_tool_gap_prefetch_total",
                                     "Turns after a tool call: prefetch fired before arrival "
                                     "(warm) or not (cold).", ["outcome"], registry=registry)
        self.tool_gap_chunks = Counter(
            "proxy_tool_gap_prefetch_chunks_total",
            "Chunks of the sessions announced during a tool call, by where their pod found "
            "them: dram (nothing to move), disk (read into DRAM before the turn), missing "
            "(recomputed), scheduled (left to the pod's scheduler for when the turn is due); and "
            "held: those of them the pod pinned until the turn is due (--announce-hold).",
            ["found"], registry=registry)
        self.queued_prefetch_chunks = Counter(
            "proxy_queued_prefetch_chunks_total",
            "Chunks of the sessions whose turn waited for admission, by where their pod found "
            "them when the wait began (dram, disk: read into DRAM during the wait, missing), "
            "and held: those the pod pinned until the turn could go.", ["found"],
            registry=registry)
        self.sessions = Gauge("proxy_sessions", "Sessions remembered.", registry=registry)
        self.stalls = Counter("proxy_stalls_total",
                              "Pods that took a turn, went silent past a stall deadline and "
                              "answered no probe, "
                              "by stage (prefill, decode) and kind (first_token, inter_token).",
                              ["stage", "kind"], registry=registry)
        self.silent_probes = Counter(
            "proxy_silent_pod_probes_total",
            "Probes of a pod a turn found silent past its stall deadline, by stage and answer "
            "(answered: busy, the turn waits on; silent: stalled, the turn moves).",
            ["stage", "answer"], registry=registry)
        self.stall_deadline = Gauge("proxy_stall_deadline_seconds",
                                    "The stall deadline last applied, by stage and kind (a "
                                    "flag's, or a multiple of the observed P99).",
                                    ["stage", "kind"], registry=registry)
        self.admission_waiting = Gauge(
            "proxy_admission_waiting", "--admit-per-pod: turns held at the door, waiting for a "
            "place among the prompts the pods compute.", registry=registry)
        self.admission_wait = Histogram(
            "proxy_admission_wait_seconds", "--admit-per-pod: how long turns waited to be let "
            "in, by how they were (free: a place was free; shortest: the fewest tokens among "
            "those waiting; aged: waited past --admit-max-wait).", ["how"], buckets=_LATENCY,
            registry=registry)
        self.stalled_pods = Gauge("proxy_stalled_pods",
                                  "Pods out of rotation after a stall, until they answer a "
                                  "probe.", registry=registry)
