"""`agentserving proxy`: run the OpenAI-compatible front door."""

from __future__ import annotations

from pathlib import Path

import click

from agentserving.core.cli import log_options, serve, settings_option
from agentserving.core.hashing import HashScheme
from agentserving.core.internal_auth import TOKEN_ENV, TOKEN_HELP
from agentserving.proxy.settings import ProxySettings, RoutingName

setting = settings_option(ProxySettings)


@click.command("proxy")
@setting("--host", help="Address to bind (0.0.0.0 in a pod).")
@setting("--port", type=click.IntRange(0, 65535), help="HTTP port.")
@setting("--kvindex", "kvindex_url",
         help="kvindex base URL; without --prefill/--decode, pods are discovered from it.")
@setting("--prefill", "prefill_urls", multiple=True,
         help="A prefill (or prefill+decode) worker's base URL; repeatable.")
@setting("--decode", "decode_urls", multiple=True,
         help="A decode worker's base URL; repeatable. None: prefill pods do both.")
@setting("--routing", type=click.Choice([r.value for r in RoutingName]),
         help="kv-aware: to the longest cached prefix, balanced by load; llm-d: llm-d's "
              "endpoint picker mirrored (sticky sessions until a pod saturates, then prefix 2 : "
              "queue 1 weighted scores; the rival of the benchmarks); session: affinity; "
              "round-robin: even spread, no KV awareness.")
@setting("--api-keys", "api_keys_file", type=click.Path(exists=True, dir_okay=False,
                                                         path_type=Path),
         help='JSON {"keys": [{"key", "tenant", "cache_salt"?}]}; when set, Bearer keys are '
              "required and each tenant's chunks are salted apart.")
@setting("--salt-secret", metavar="SECRET",
         help="Secret under which each tenant's default cache_salt is derived (an HMAC of the "
              "tenant's name); unset: a digest of every key in --api-keys. Keep it stable: a "
              "new secret makes every tenant's cached KV unreachable (recomputed, never mixed).")
@setting("--internal-token", envvar=TOKEN_ENV, metavar="TOKEN", help=TOKEN_HELP)
@setting("--discovery-interval", "discovery_interval_s", type=click.FloatRange(min=0.05),
         help="Seconds between kvindex pod-registry refreshes.")
@setting("--empty-registry-grace", "empty_registry_grace_s", type=click.FloatRange(min=0),
         help="Seconds the proxy keeps routing to the pods it knew when the kvindex registry "
         "suddenly lists none: an outage of the kvindex's store longer than the pods' lease "
         "lapses every lease at once, and the pods register again at their next heartbeat. "
         "Keep it near the kvindex's --lease-ttl; 0: follow the registry at once.")
@setting("--kvindex-timeout", "kvindex_timeout_s", type=click.FloatRange(min=0.01),
         help="Seconds to wait for the kvindex before routing without it.")
@setting("--upstream-timeout", "upstream_timeout_s", type=click.FloatRange(min=0.1),
         help="Seconds a worker may take to answer a turn.")
@setting("--max-attempts", type=click.IntRange(min=1),
         help="Pods tried for one turn before answering 502.")
@setting("--load-penalty-tokens", type=click.IntRange(min=0),
         help="kv-aware: cached tokens worth giving up to avoid one more in-flight turn; "
              "decode pods: the queued prompt tokens one in-flight turn weighs as.")
@setting("--chunk-size", type=click.IntRange(min=1),
         help="Tokens per KV chunk (turns kvindex scores into tokens).")
@setting("--prompt-hash-scheme", type=click.Choice([s.value for s in HashScheme]),
         help="kv-aware: hash each token-id prompt with this scheme (blocks of --chunk-size) "
              "for the kvindex lookup, instead of using the chunk hashes the pods returned on "
              "the session's previous turn; vllm-sha256 with --chunk-size 128 routes plain "
              "vLLM pods by their own KV events (the kvindex's --vllm-events). Unset: the "
              "pods' hashes.")
@setting("--local-prefill-tokens", type=click.IntRange(min=0),
         help="P/D: a turn whose decode pod already holds the session's context and would "
              "compute at most this many prompt tokens runs there, skipping the prefill pod and "
              "the KV hand-off (conditional disaggregation); 0 always disaggregates.")
@setting("--max-prefill-backlog", type=click.IntRange(min=0),
         help="P/D: when every prefill pod already has this many turns in flight, run the turn "
              "whole on a decode pod instead of queueing it (0: no limit).")
@setting("--balance-tokens", type=click.IntRange(min=0),
         help="P/D: place turns by queued work over every pod (0: off). A session's turn "
              "leaves its own pod, when that pod is backed up, for the least-loaded other pod "
              "(a decode pod, or a prefill pod, which then hosts the session) if that pod's "
              "queue plus the context it lacks (by the kvindex) is this many tokens below the "
              "own pod's queue plus the new tokens. A first turn runs whole on the "
              "least-loaded decode pod when it has less queued than the prefill pod, whole on "
              "the prefill pod (which then hosts the session) when the decode pod has "
              "anything queued, else P/D. Queues are in prompt tokens, a turn in flight "
              "weighing --load-penalty-tokens. Measured: docs/replay.md, off by default.")
@setting("--admit-per-pod", type=click.IntRange(min=0),
         help="Shortest prompt first over the whole fleet (0: off). Once every pod has this "
              "many prompts it is computing (a turn run whole until its first token, a P/D "
              "turn until its prefill pod answers), a new turn waits in the proxy, and each "
              "place that frees goes to the waiting turn with the fewest "
              "prompt tokens to compute (a session's append on its own pod: its new tokens; "
              "a first turn: its whole prompt); turns are routed when admitted. Measured: "
              "docs/replay.md.")
@setting("--admit-max-wait", "admit_max_wait_s", type=click.FloatRange(min=0, min_open=True),
         help="Seconds a turn held for admission waits before it goes ahead of shorter ones "
              "(no turn starves behind a stream of short ones).")
@setting("--prefill-hosts-sessions/--no-prefill-hosts-sessions",
         help="P/D: a prefill pod with nothing in flight, when every decode pod is busy, runs "
              "a first turn whole and becomes the session's own pod, its appends running there "
              "as on a decode pod: the prefill pool's idle time serves sessions too.")
@setting("--shared-sessions/--no-shared-sessions",
         help="Keep each session's routing record (its last turn's chunk hashes and pods) in "
              "the kvindex too, so that every proxy replica behind a Service routes a "
              "session's turns as one proxy would, and a restarted proxy forgets nothing: one "
              "kvindex read before each turn of a session, one write after it. Needs "
              "--kvindex; the operator sets it when proxy.replicas > 1.")
@setting("--residency-replica/--no-residency-replica",
         help="kv-aware: keep the kvindex's residency (which pod holds which chunk in which "
              "tier) in this process, listed once and then followed through the kvindex's "
              "change feed (GET /v1/residency/changes), and answer each turn's lookup from it "
              "instead of a kvindex round trip. While the replica is stale (see "
              "--replica-max-lag) lookups go to the kvindex as without it.")
@setting("--replica-max-lag", "replica_max_lag_s", type=click.FloatRange(min=0.01),
         help="Seconds without an answer from the kvindex's feed after which the replica is "
              "stale and each lookup asks the kvindex itself.")
@setting("--replica-resync", "replica_resync_s", type=click.FloatRange(min=0.01),
         help="Seconds between the replica's full listings of the kvindex's residency (they "
              "repair a change the kvindex applied but could not publish).")
@setting("--max-sessions", type=click.IntRange(min=1),
         help="Sessions whose routing state the proxy keeps at most (least recently used go "
              "first).")
@setting("--session-idle-ttl", "session_idle_ttl_s", type=click.FloatRange(min=0),
         help="Seconds after a session's last turn that the proxy forgets its routing state "
              "(match the kvindex's --session-idle-ttl); a turn with agent_memory."
              "close_session forgets it at once. 0: only --max-sessions bounds them.")
@setting("--stored-response-ttl", "stored_response_ttl_s",
         type=click.FloatRange(min=0, min_open=True),
         help="Without --kvindex: seconds the proxy keeps a stored Responses API object "
              "(store: true) for previous_response_id. With --kvindex the kvindex keeps them "
              "(its --stored-response-ttl), shared by every proxy replica.")
@setting("--max-stored-responses", type=click.IntRange(min=1),
         help="Without --kvindex: stored responses kept at most in this process (the oldest "
              "go first).")
@setting("--activity-half-life", "activity_half_life_s",
         type=click.FloatRange(min=0, min_open=True),
         help="P/D: a new session goes to the decode pod with the least recent work plus "
              "momentary load (the turns placed on it, weighed by the prompt tokens they "
              "compute there, each halving in weight every this many seconds; an agent "
              "between tool calls keeps its pod's level up).")
@setting("--tool-prefetch/--no-tool-prefetch",
         help="While a turn's tool call runs, announce the session's next turn to its pod, so "
         "the session's KV is back in DRAM when it arrives (see --prefetch-lead).")
@setting("--prefetch-lead", "prefetch_lead_s", type=click.FloatRange(min=0),
         help="Seconds before a tool call's predicted return to announce the session's next "
              "turn to its pod, which then moves its KV to DRAM: at once, or, where the pod's "
              "scheduler predicts admissions (a ShadowScheduler), when it predicts the turn for "
              "its next step.")
@setting("--queued-prefetch/--no-queued-prefetch",
         help="While a turn waits for admission (--admit-per-pod), once it is among those "
              "that take the next two rounds of places, ask its session's pod to read the "
              "session's KV from disk into DRAM and to hold it there for --announce-hold "
              "seconds (not held with --announce-hold 0): the wait moves the KV instead of "
              "the turn's prefill reading it. Off by default, as --announce-hold: measured "
              "to take disk reads off the turns but to cost session time where pods are "
              "saturated (docs/benchmarks.md, agent pressure).")
@setting("--announce-hold", "announce_hold_s", type=click.FloatRange(min=0, max=3600),
         help="Seconds past a tool call's predicted return that its pod holds the session's KV "
              "from the announce on (--tool-prefetch): a pin on what DRAM and disk hold at the "
              "announce and on what the announce reads into DRAM, so the turns the pod serves "
              "meanwhile do not evict it before the turn arrives. A pin like any other: within "
              "the pod's pin share, lapsing by itself. 0 (the default): announce without "
              "holding; see --queued-prefetch for what was measured.")
@setting("--tool-pin/--no-tool-pin",
         help="Pin a session's KV in every tier that honours pins after a turn that ends in a "
              "tool call (the caller names it in x-agentserving-next-tool, or the answer calls "
              "one), for --pin-gap-multiple times the predicted tool gap within --pin-ttl-floor "
              "and --pin-ttl-cap: the agent is back when the tool returns. A turn that hands "
              "back to a person is not pinned; a turn's own agent_memory wins. Off by "
              "default: measured to cost more than it saves where pods are saturated "
              "(docs/benchmarks.md, agent pressure).")
@setting("--fork-placement/--no-fork-placement",
         help="A branch's first turn (x-parent-session-id) starts on its parent's pod, and the "
              "kvindex copies the parent's session record (its context, pins, priority) to it.")
@setting("--context-change-evict/--no-context-change-evict",
         help="When a turn's prompt is not an extension of its session's previous context "
              "(the agent compacted or edited its history: the chunk chain leaves the previous "
              "one before its end), evict the chunks only the dropped context held from every "
              "tier of every pod, through the kvindex; chunks a fork or another live session "
              "references stay.")
@setting("--pin-ttl-floor", "pin_ttl_floor_s", type=click.FloatRange(min=0, min_open=True),
         help="Seconds at least of a pin asked for without a TTL (cache_control without ttl, "
              "agent_memory.pin): such a pin lasts --pin-gap-multiple times the session's "
              "predicted tool gap, within --pin-ttl-floor and --pin-ttl-cap.")
@setting("--pin-ttl-cap", "pin_ttl_cap_s", type=click.FloatRange(min=0, max=86400,
                                                                 min_open=True),
         help="Seconds at most of a pin asked for without a TTL.")
@setting("--pin-gap-multiple", type=click.FloatRange(min=1),
         help="A pin asked for without a TTL lasts this multiple of the predicted tool gap.")
@setting("--max-model-len", type=click.IntRange(min=2),
         help="The model's context length in tokens: a turn whose max_tokens alone exceeds it, "
              "or whose token-id prompt plus max_tokens does, gets a 400 naming the field "
              "before any pod works on it (a text prompt is left to the engine, which "
              "tokenizes it). Unset: the largest max_model_len the pods list in GET /v1/models.")
@setting("--stall-detection/--no-stall-detection",
         help="Move a turn off a pod that goes silent past its stage's deadline (below) and "
              "then does not answer GET /v1/models within --stall-probe-timeout (a busy pod "
              "answers, a stopped one does not), as off a dead one, and route nothing to that "
              "pod until it answers again. While the pod answers, the turn waits on and the "
              "pod is asked again after each further deadline. A stream is moved only while "
              "no token reached the caller; after that it ends with an error event (code "
              "stalled), which the caller may retry.")
@setting("--stall-prefill-first-token", "stall_prefill_first_token_s",
         type=click.FloatRange(min=0, min_open=True),
         help="Seconds a pod computing a prompt (P/D's prefill call, or a turn run whole) may "
              "take to its first token. Unset: adaptive (--stall-multiple).")
@setting("--stall-prefill-inter-token", "stall_prefill_inter_token_s",
         type=click.FloatRange(min=0, min_open=True),
         help="Seconds between two streamed tokens of a turn run whole on one pod. Unset: "
              "adaptive.")
@setting("--stall-decode-first-token", "stall_decode_first_token_s",
         type=click.FloatRange(min=0, min_open=True),
         help="Seconds a P/D decode pod may take to its first token (its KV pull included). "
              "Unset: adaptive.")
@setting("--stall-decode-inter-token", "stall_decode_inter_token_s",
         type=click.FloatRange(min=0, min_open=True),
         help="Seconds between two streamed tokens of a P/D decode pod. Unset: adaptive.")
@setting("--stall-multiple", type=click.FloatRange(min=1),
         help="Adaptive deadlines: this multiple of the P99 of the last 512 observed first "
              "tokens (or inter-token gaps) of the stage, never under the floor.")
@setting("--stall-first-token-floor", "stall_first_token_floor_s",
         type=click.FloatRange(min=0, min_open=True),
         help="Adaptive first-token deadlines are never shorter than this (seconds).")
@setting("--stall-inter-token-floor", "stall_inter_token_floor_s",
         type=click.FloatRange(min=0, min_open=True),
         help="Adaptive inter-token deadlines are never shorter than this (seconds). A busy "
              "pod's decodes wait out other requests' prefill steps (seconds on a CPU pod): "
              "each wait past the deadline costs a probe of the pod.")
@setting("--stall-first-token-initial", "stall_first_token_initial_s",
         type=click.FloatRange(min=0, min_open=True),
         help="Adaptive first-token deadline until --stall-min-samples are observed (seconds).")
@setting("--stall-inter-token-initial", "stall_inter_token_initial_s",
         type=click.FloatRange(min=0, min_open=True),
         help="Adaptive inter-token deadline until --stall-min-samples are observed (seconds).")
@setting("--stall-min-samples", type=click.IntRange(min=1),
         help="Observations of a stage's latency before its adaptive deadline follows them.")
@setting("--stall-probe-timeout", "stall_probe_timeout_s",
         type=click.FloatRange(min=0, min_open=True),
         help="Seconds a pod found silent past a stall deadline has to answer GET /v1/models "
              "before it is called stalled (also the timeout of a stalled pod's probes).")
@setting("--probe-interval", "probe_interval_s", type=click.FloatRange(min=0, min_open=True),
         help="Seconds between the GET /v1/models probes of a stalled pod.")
@log_options(setting)
def command(**kwargs: object) -> None:
    """Run the proxy: OpenAI API in, each turn routed to where its KV already is."""
    from agentserving.proxy.app import create_app

    serve(create_app, settings_from_params(kwargs))


def settings_from_params(params: dict[str, object]) -> ProxySettings:
    """The proxy's settings from this command's parsed parameters (starts nothing)."""
    lists = {key: list(params.get(key) or ()) for key in ("prefill_urls", "decode_urls")}
    return ProxySettings(**{**params, **lists})  # type: ignore[arg-type]
