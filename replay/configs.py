"""The configurations `agentserving compare` compares: what each one deploys, on which engine.

Pure: a ``BenchConfig`` names a system users run (or agentserving, or agentserving with one
part taken out) and ``fleet_spec`` turns it, with the run's sizes, into the ``FleetSpec`` of a
local fleet. Every configuration of one engine gets the same worker count, model and device KV.

On vLLM (the default engine, what users deploy):

- ``vllm-rr``: independent vLLM pods with their automatic prefix cache, round-robin
  (production-stack's default router);
- ``vllm-session``: the same pods behind session affinity (a sticky-session router);
- ``vllm-precise``: the same pods behind precise prefix-cache routing driven by their own KV
  events (the strongest router users deploy today: llm-d's precise scorer);
- ``llmd``: what llm-d's tiered prefix-cache guide deploys: the same vLLM pods, each with
  LMCache's CPU tier of the same DRAM (its CPU guide configures no disk tier; LMCache's reload
  copied whole before the forward pass, as stock LMCache does), each pod prefilling and
  decoding, behind llm-d's endpoint picker mirrored (the proxy's ``--routing llm-d``: sticky
  sessions until a pod saturates, else the precise prefix scorer's tier-weighted match, 2 : 1
  against the queue; ``proxy.routing.LlmdScheduler`` says where it differs). No P/D, no
  admission, no pins, no prefetch, no fork placement, no eviction on a context change: what
  agentserving adds on top;
- ``agentserving``: vLLM + LMCache tiers (CPU DRAM, local disk), kvindex routing, P/D with
  conditional disaggregation, seed 003's Longcap-FCFS + Dynamic Chunk inside vLLM's
  scheduler on the prefill pods, under the ShadowScheduler (the N+1 window's LMCache
  disk -> DRAM prefetch);
- ``agentserving-fcfs``: the same without the scheduler (vLLM's own FCFS on the prefill pod);
- ``agentserving-noprefetch``: the same scheduler without the ShadowScheduler's prefetch, no
  turn announced during its tool call and none read for while it waits for admission;
- ``agentserving-hold`` (not run by default): the same holding an announced turn's KV on its
  pod until the turn is due, and reading for a turn waiting for admission once it is among
  the next to go, held too (the proxy's ``--announce-hold 10 --queued-prefetch``; measured to
  take disk reads off the turns but to cost session time on the agent-pressure workload, so
  off in agentserving);
- ``agentserving-nolayerwise``: the same with every vLLM pod's KV reload from LMCache's tiers
  copied whole before the forward pass (``--no-kv-layerwise-load``), not layer by layer behind
  it;
- ``agentserving-allpd``: the same without conditional disaggregation: every turn's prefill
  runs on the prefill pod, as in seed 003 (the proxy's ``--local-prefill-tokens 0
  --max-prefill-backlog 0``);
- ``agentserving-toolpin`` (not run by default): the same pinning a session's KV for the
  predicted gap after each turn that ends in a tool call (the proxy's ``--tool-pin``; measured
  to cost more than it saves on the agent-pressure workload, so off in agentserving);
- ``agentserving-noadmit``: the same without admission at the proxy (``--admit-per-pod 0``:
  every turn straight to its pod, each engine serving its queue in arrival order);
- ``agentserving-balanced`` (not run by default): the same placing turns by queued work over
  every pod (the proxy's ``--balance-tokens``): a session whose pod is backed up moves to the
  least-loaded pod, cold turns go where less is queued, and the prefill pod hosts sessions.

On the reference engine (the quick run): ``baseline`` (round-robin workers with no cross-turn
reuse at all), ``baseline-apc`` (round-robin workers reusing only their own prefix cache) and
``agentserving``.
"""

from __future__ import annotations

import urllib.parse
from dataclasses import dataclass, field
from typing import Any

from agentserving.core.hashing import HashScheme
from agentserving.engine.scheduler.policy import DECODE_POD_CHUNK_TOKENS, DECODE_POD_POLICY
from agentserving.prefill.shadow import SHADOW_OPTIONS, policy_named

# Decode pods prefill the short appends the proxy keeps off the prefill pod (conditional
# disaggregation): small chunks, each followed by decode-only steps, so the turns decoding beside
# them keep their pace (measured: docs/replay.md). The reference engine's scheduler only.
DECODE_POD_ARGS = ["--prefill-chunk-tokens", str(DECODE_POD_CHUNK_TOKENS),
                   "--scheduler-policy", DECODE_POD_POLICY]
# agentserving's prefill-pod scheduling policy on each engine (measured: docs/replay.md)
# On vLLM: Longcap-FCFS + Dynamic Chunk under the ShadowScheduler, whose N+1 window starts the
# LMCache disk -> DRAM prefetch of the turns about to be admitted (services/prefill/vllm_plugin).
# Shorts shortest-first: with every prefill on the prefill pod (agentserving-allpd, agent mix,
# one run each, December 2026) the short band in arrival order gave short turns a TTFT P50 /
# P85 of 1.24 / 3.73 s against vLLM's FCFS's 0.76 / 1.88 s; shortest-first 0.75 / 1.27 s.
VLLM_PREFILL_POLICY = "longcap-dynamic?short_order=shortest"
PREFILL_POLICY = {"reference": "fcfs", "vllm": VLLM_PREFILL_POLICY + "&lookahead=5"}
# ... and on its decode pods, which prefill what conditional disaggregation keeps off the
# prefill pod (short appends, and first turns while the prefill pod is busy): None keeps the
# engine's own scheduler there (vLLM's FCFS; the reference engine's DECODE_POD_ARGS).
# Longcap shortest-first there too (--decode-policy 'longcap-dynamic?short_order=shortest',
# three `make run`s, December 2026) made short turns faster than agentserving-fcfs in every
# run (TTFT P50 x1.80 / x1.14 / x2.08, P85 x1.14 / x1.20 / x1.52) but cost the tail: E2E P95
# x1.79 / x0.94 / x1.78 of agentserving-fcfs's and x0.97 / x0.68 / x1.00 of vllm-precise's
# (x0.43-0.71 with vLLM's own), targets met 16 / 19 / 17 of 23 (19 / 17 / 19): the decode
# pods' long prefills, one at a time behind a stream of appends, became the slowest turns.
# With four long prefills at a time and half the step for them while shorts wait
# ('...&max_long_running=4&long_cap=0.5', two A/Bs against agentserving-fcfs): short TTFT P50
# / P85 x1.56 / x1.95 and x1.83 / x1.41 better, but E2E P95 x0.93 and x1.55, req/s x1.02 and
# x0.86: the tail still pays in one run of two. Bounding a long turn's wait behind the shorts
# to 1 s as well (DECODE_POD_LONGCAP, three `make run`s with it as the default, table
# decode-longcap-wait in docs/replay.md): short TTFT P50 x1.17 / x0.55 / x0.75 and P85 x0.70 /
# x0.94 / x1.06 of agentserving-fcfs's, E2E P95 x1.12 / x1.51 / x1.03, targets met 18 / 17 /
# 20 of 23: the tail still pays in every run and the short turns' gain is not steady; not the
# default either. On those pods the policy left 25-55 % of its steps to vLLM's own pass
# (report.json's policy_steps): with 64 blocks, its KV check found no safe grant that often.
DECODE_POD_LONGCAP = ("longcap-dynamic?short_order=shortest&max_long_running=4&long_cap=0.5"
                      "&long_max_wait_s=1")
DECODE_POLICY: dict[str, str | None] = {"reference": None, "vllm": None}
VLLM_STEP_TOKENS = 2048  # tokens per vLLM step (--max-num-batched-tokens) on every vLLM pod
VLLM_BLOCK_TOKENS = 128  # vLLM-CPU's KV block
# Device KV per vLLM pod: 64 blocks = 8,192 tokens (8,064 usable), room for bench-agent's
# longest turn (7.2k tokens with its output) but under a third of a pod's share of its 14
# sessions' contexts with session affinity: the working set does not fit, as in seed 003
# (with 128 blocks vllm-session still reached 94 % of the ideal hit; with 64, 75 %).
DEVICE_KV_BLOCKS = 64
# agentserving's proxy on vLLM: a first turn that finds the prefill pod busy runs whole on the
# least-loaded decode pod (E2E P95 4.6 s -> 3.1 s on bench-agent, req/s 2.51 -> 2.76, hit
# unchanged; measured December 2026 with 128 device blocks). The prefill pod does not host
# sessions (--prefill-hosts-sessions off): a hosted session's turns keep the prefill pod busy,
# so every first turn meanwhile runs whole on a decode pod, where the appends of the sessions
# living there queue behind it (one measured run: the prefill pod hosted one session from
# 6.6 s to 11.4 s, five first turns went whole to the decode pods, and appends on decode-1
# waited 4-5 s for their first token); an A/B of two pairs: P95 4.3 s off, 5.3-5.9 s on.
# Shortest prompt first over the fleet (--admit-per-pod 1): a burst of first turns on the
# Mooncake sample no longer sets the median turn's wait (E2E P50 x0.66 / x0.57 of vllm-precise's,
# against x1.44 / x1.18 without), and on the agent mix short appends wait less behind first
# turns (short TTFT P85 x0.55-0.86 of the same without in six runs, P50 x0.57-1.51, at
# x0.83-1.08 of its req/s; agentserving-noadmit below, docs/replay.md and docs/benchmarks.md).
# (services/proxy/settings.py: ENGINE_PROXY_SETTINGS, the operator's defaults too)
# agentserving-balanced (not among the defaults): placement by queued work over every pod,
# measured beside agentserving in docs/replay.md (table balanced-placement)
BALANCED_PROXY_ARGS = ("--balance-tokens", "1024", "--max-prefill-backlog", "0")
# The workload's pace per engine (--time-scale). On vLLM the bench replays bench-agent at twice
# its own speed: at its own times agentserving finished 33-38 s after the start, of which the
# arrivals took 23 s, so req/s measured the arrival times more than any configuration's capacity
# (three runs: x1.60-1.69 over vllm-rr, x1.05-1.25 over vllm-precise; at 0.5, x1.84-2.10 and
# x1.11-1.67, measured December 2026). The reference engine's quick run keeps the workload's
# own times.
DEFAULT_TIME_SCALE = {"reference": 1.0, "vllm": 0.5}
# The first configuration of each engine is the one the others' ratios are taken against.
# On vLLM the default is what users deploy against agentserving: three fleets to start (the
# three stock routers share one; llm-d's tiered pods are the third), about 8 minutes on 2
# cores.
DEFAULT_CONFIGS = {"reference": ("baseline", "agentserving"),
                   "vllm": ("vllm-rr", "vllm-session", "vllm-precise", "llmd", "agentserving")}
# agentserving with one of its parts taken out (`agentserving compare --ablations`): a fleet
# of its own each, about a minute and a half apiece on 2 cores.
ABLATIONS = {"reference": (),
             "vllm": ("agentserving-fcfs", "agentserving-noprefetch", "agentserving-nolayerwise",
                      "agentserving-allpd", "agentserving-noadmit")}


# llmd's proxy: llm-d's picker (--routing llm-d) hashing each prompt itself, as its precise
# scorer tokenizes and hashes every request (LMCache's chunks, in LMCache's scheme), and none
# of what agentserving's proxy adds
LLMD_PROXY_ARGS = ("--prompt-hash-scheme", HashScheme.LMCACHE_BUILTIN.value,
                   "--admit-per-pod", "0", "--max-prefill-backlog", "0", "--no-tool-prefetch",
                   "--no-tool-pin", "--no-fork-placement", "--no-context-change-evict")


@dataclass(frozen=True)
class BenchConfig:
    name: str
    engines: tuple[str, ...]
    description: str
    routing: str
    disaggregated: bool = False  # prefill + decode pools (else N workers that do both)
    tiers: bool = True  # LMCache CPU DRAM (+ disk) tiers, kvindex residency
    own_prefix_cache_only: bool = False  # reference engine: a CPU tier, but no disk, no P/D
    prefill_policy: str | None = None  # None: the engine's PREFILL_POLICY; "fcfs": stock
    precise: bool = False  # vLLM KV events -> kvindex; the proxy hashes prompts vLLM's way
    proxy_args: tuple[str, ...] = ()  # agentserving's proxy, after the engine's and the run's
    layerwise_load: bool = True  # the workers' --kv-layerwise-load
    disk_tier: bool = True  # with tiers: LMCache's local disk tier below the DRAM one


CONFIGS: dict[str, BenchConfig] = {c.name: c for c in (
    BenchConfig("vllm-rr", ("vllm",), "independent vLLM pods, their automatic prefix cache, "
                "round-robin (production-stack's default)", routing="round-robin", tiers=False),
    BenchConfig("vllm-session", ("vllm",), "independent vLLM pods, their automatic prefix "
                "cache, session-affinity routing (a sticky-session router)", routing="session",
                tiers=False),
    BenchConfig("vllm-precise", ("vllm",), "independent vLLM pods, their automatic prefix "
                "cache, precise prefix-cache routing by their own KV events (llm-d's precise "
                "scorer: the kvindex ingests the events, the proxy hashes prompts vLLM's way)",
                routing="kv-aware", tiers=False, precise=True),
    BenchConfig("baseline", ("reference",), "independent workers, round-robin, a CPU tier "
                "too small for one chunk: no cross-turn KV reuse, no P/D",
                routing="round-robin"),
    BenchConfig("baseline-apc", ("reference",), "independent workers, round-robin, each "
                "reusing only what it computed itself (like vLLM's APC)", routing="round-robin",
                own_prefix_cache_only=True),
    BenchConfig("llmd", ("vllm",), "llm-d's tiered prefix cache: vLLM pods with LMCache's "
                "CPU tier (no disk), each prefilling and decoding, behind llm-d's endpoint "
                "picker (sticky sessions until a pod saturates, precise tier-weighted prefix "
                "scoring against queue depth); no P/D, admission, pins or prefetch",
                routing="llm-d", disk_tier=False, layerwise_load=False,
                proxy_args=LLMD_PROXY_ARGS),
    BenchConfig("agentserving", ("reference", "vllm"), "LMCache CPU + disk tiers, kvindex "
                "routing, P/D with conditional disaggregation, (on vLLM) seed 003's prefill "
                "scheduling in vLLM's scheduler",
                routing="kv-aware", disaggregated=True),
    BenchConfig("agentserving-fcfs", ("reference", "vllm"), "agentserving without its prefill "
                "scheduler (the engine's own FCFS on the prefill pods)", routing="kv-aware",
                disaggregated=True, prefill_policy="fcfs"),
    BenchConfig("agentserving-noprefetch", ("vllm",), "agentserving without prefetch: no "
                "ShadowScheduler (Longcap + Dynamic Chunk alone), no turn announced during "
                "its tool call, none read for while it waits for admission (a session's KV on "
                "disk is read when its turn is scheduled)",
                routing="kv-aware", disaggregated=True, prefill_policy=VLLM_PREFILL_POLICY,
                proxy_args=("--no-tool-prefetch", "--no-queued-prefetch")),
    BenchConfig("agentserving-hold", ("vllm",), "agentserving holding an announced turn's "
                "KV on its pod until the turn is due, and reading (and holding) a waiting "
                "turn's KV once it is among the next to be admitted (--announce-hold 10 "
                "--queued-prefetch)", routing="kv-aware", disaggregated=True,
                proxy_args=("--announce-hold", "10", "--queued-prefetch")),
    BenchConfig("agentserving-nolayerwise", ("vllm",), "agentserving without the layer-wise "
                "KV load: a reload from LMCache's tiers is copied into vLLM's pages whole, "
                "before the forward pass, not layer by layer behind it", routing="kv-aware",
                disaggregated=True, layerwise_load=False),
    BenchConfig("agentserving-balanced", ("vllm",), "agentserving placing turns by queued "
                "work over every pod (the proxy's --balance-tokens 1024 in place of "
                "--max-prefill-backlog 1): a backed-up session moves, cold turns go where less "
                "is queued, the prefill pod hosting sessions", routing="kv-aware",
                disaggregated=True, proxy_args=BALANCED_PROXY_ARGS),
    BenchConfig("agentserving-noadmit", ("vllm",), "agentserving without admission at the "
                "proxy: every turn goes straight to its pod, each pod's engine serving its "
                "queue in arrival order (--admit-per-pod 0)", routing="kv-aware",
                disaggregated=True, proxy_args=("--admit-per-pod", "0")),
    BenchConfig("agentserving-toolpin", ("vllm",), "agentserving with TTL pins: a turn "
                "ending in a tool call pins its session's KV for twice the predicted gap "
                "(--tool-pin)", routing="kv-aware", disaggregated=True,
                proxy_args=("--tool-pin",)),
    BenchConfig("agentserving-allpd", ("vllm",), "agentserving without conditional "
                "disaggregation: every turn's prefill on the prefill pod, as in seed 003",
                routing="kv-aware", disaggregated=True,
                proxy_args=("--local-prefill-tokens", "0", "--max-prefill-backlog", "0")),
)}


def resolve(names: str, engine: str, ablations: bool = False) -> list[BenchConfig]:
    """``--configs`` (comma-separated, or empty for the engine's defaults; with ``ablations``,
    agentserving's ablations after them) -> configs; an unknown name or one the engine cannot
    run is a ``ValueError`` naming it."""
    wanted = [n.strip() for n in names.split(",") if n.strip()] or list(DEFAULT_CONFIGS[engine])
    if ablations:
        wanted += [n for n in ABLATIONS[engine] if n not in wanted]
    out = []
    for name in wanted:
        config = CONFIGS.get(name)
        if config is None:
            raise ValueError(f"unknown configuration {name!r}; known: {sorted(CONFIGS)}")
        if engine not in config.engines:
            raise ValueError(f"configuration {name!r} runs on {'/'.join(config.engines)}, "
                             f"not --engine {engine}")
        out.append(config)
    return out


@dataclass
class FleetSizes:
    """What every configuration of one run shares."""
    engine: str = "vllm"
    prefill: int = 1
    decode: int = 2
    model: str = "tiny"
    cpu_cache_gib: float = 2.0
    disk_cache_gib: float = 4.0
    disk_io: str = "buffered"  # the disk tier's I/O: "direct" reads past the page cache
    device_kv_blocks: int | None = None  # vLLM: device KV per pod, in blocks
    worker_args: list[str] = field(default_factory=list)
    worker_env: dict[str, str] = field(default_factory=dict)
    proxy_args: list[str] = field(default_factory=list)  # agentserving's proxy only
    prefill_policy: str | None = None  # agentserving's prefill pods (None: PREFILL_POLICY)
    decode_policy: str | None = None  # agentserving's decode pods (None: DECODE_POLICY)
    startup_timeout_s: float = 180.0
    worker_command: list[str] | None = None
    # agentserving's fleets: the token between their components (core.internal_auth), as
    # the deployment has it; the fleets of what users run today have none
    internal_token: str | None = field(default=None, repr=False)


def engine_proxy_args(engine: str) -> list[str]:
    """The flags of agentserving's proxy in front of ``engine``'s pods beyond its defaults."""
    from agentserving.core.argv import settings_argv
    from agentserving.proxy.cli import command as proxy_command
    from agentserving.proxy.settings import ENGINE_PROXY_SETTINGS, ProxySettings

    return settings_argv(proxy_command, ProxySettings, ENGINE_PROXY_SETTINGS.get(engine, {}))


def topology_error(prefill: int, decode: int) -> str | None:
    """Why a fleet of these pools cannot serve (None: it can): decode pods only decode what a
    prefill pod prefilled, so decode pods with no prefill pod would never answer a turn."""
    if decode > 0 and prefill == 0:
        return (f"{decode} decode pods and no prefill pod: a decode pod only continues a "
                "prompt a prefill pod computed; give --prefill 1 or more, or run "
                f"--prefill {decode} --decode 0 for pods that do both")
    return None


def without_shadow(spec: str) -> str:
    """A ``--scheduler-policy`` spec with the ShadowScheduler taken out (its options dropped,
    ``shadow`` named by its base policy): the policy a no-prefetch ablation runs."""
    name, _, query = spec.partition("?")
    opts = {k: v for k, v in urllib.parse.parse_qsl(query) if k not in SHADOW_OPTIONS}
    name = policy_named(name, opts)
    return name + ("?" + "&".join(f"{k}={v}" for k, v in opts.items()) if opts else "")


def schedulers(role_args: dict[str, list[str]]) -> dict[str, str]:
    """What each pool of a fleet schedules its prefills with, as ``report.json`` names it: the
    ``--scheduler-policy`` its pods get, or ``engine`` for the engine's own scheduler."""
    out = {}
    for role in ("prefill", "decode"):
        args = role_args.get(role, [])
        out[role] = args[args.index("--scheduler-policy") + 1] \
            if "--scheduler-policy" in args[:-1] else "engine"
    return out


def fleet_spec(config: BenchConfig, sizes: FleetSizes) -> Any:
    from agentserving.replay.fleet.topology import FleetSpec

    engine = sizes.engine
    worker_args = list(sizes.worker_args)
    if engine == "vllm":
        # vLLM's own chunked-prefill budget for online serving, the same for every config
        worker_args += ["--enforce-eager", "--prefill-chunk-tokens", str(VLLM_STEP_TOKENS),
                        "--kv-block-size", str(VLLM_BLOCK_TOKENS)]
        if sizes.device_kv_blocks:  # a context vLLM cannot hold is refused, not queued forever
            tokens = (sizes.device_kv_blocks - 1) * VLLM_BLOCK_TOKENS  # vLLM keeps a null block
            worker_args += ["--kv-cache-blocks", str(sizes.device_kv_blocks),
                            "--max-model-len", str(tokens)]
        if not config.tiers:
            worker_args += ["--vllm-kv-connector", "none"]
    common: dict[str, Any] = dict(model=sizes.model, worker_args=worker_args,
                                  kv_layerwise_load=config.layerwise_load,
                                  worker_env=dict(sizes.worker_env), engine=engine,
                                  startup_timeout_s=sizes.startup_timeout_s,
                                  worker_command=sizes.worker_command, routing=config.routing)
    workers = sizes.prefill + sizes.decode
    if not config.disaggregated and config.tiers and engine == "vllm":  # llmd
        return FleetSpec(prefill=0, decode=0, both=workers, cpu_cache_gib=sizes.cpu_cache_gib,
                         disk_cache_gib=sizes.disk_cache_gib if config.disk_tier else 0.0,
                         disk_io=sizes.disk_io, proxy_args=list(config.proxy_args),
                         internal_token=sizes.internal_token, **common)
    if not config.disaggregated:
        if engine == "vllm" and not config.tiers:
            # vllm-rr, -session and -precise deploy the same pods, each with its device prefix
            # cache alone, publishing its KV events (precise's proxy alone reads them, through
            # the kvindex, and hashes prompts vLLM's way, in vLLM's block size): one fleet
            # serves the three in turn, its proxy swapped and the pods' prefix caches reset
            # between them (POST /reset_prefix_cache, a vLLM dev-mode route)
            common["worker_env"].update(VLLM_SERVER_DEV_MODE="1")
            return FleetSpec(prefill=0, decode=0, both=workers, kv_events=True,
                             chunk_size=VLLM_BLOCK_TOKENS, cpu_cache_gib=sizes.cpu_cache_gib,
                             disk_cache_gib=0.0, proxy_args=[
                                 "--prompt-hash-scheme", HashScheme.VLLM_SHA256.value]
                             if config.precise else [], **common)
        if config.own_prefix_cache_only:  # reference: a CPU tier, nothing else
            return FleetSpec(prefill=0, decode=0, both=workers, cpu_cache_gib=sizes.cpu_cache_gib,
                             disk_cache_gib=0.0, **common)
        # 1 MiB of CPU tier holds no 256-token chunk of even the tiny model: no reuse.
        return FleetSpec(prefill=0, decode=0, both=workers, cpu_cache_gib=0.001,
                         disk_cache_gib=0.0, **common)
    policy = config.prefill_policy or sizes.prefill_policy or PREFILL_POLICY[engine]
    role_args = {"prefill": ["--scheduler-policy", policy]}
    decode_policy = sizes.decode_policy or DECODE_POLICY[engine]
    if config.prefill_policy == "fcfs":  # the ablation: the engine's own scheduler everywhere
        decode_policy = None
    elif config.prefill_policy and decode_policy:  # noprefetch: the same, without the shadow
        decode_policy = without_shadow(decode_policy)
    if decode_policy:
        role_args["decode"] = ["--scheduler-policy", decode_policy]
    elif engine == "reference":
        role_args["decode"] = list(DECODE_POD_ARGS)
    proxy_args = [*engine_proxy_args(engine), *sizes.proxy_args, *config.proxy_args]
    return FleetSpec(prefill=sizes.prefill, decode=sizes.decode,
                     cpu_cache_gib=sizes.cpu_cache_gib, disk_cache_gib=sizes.disk_cache_gib,
                     disk_io=sizes.disk_io, role_args=role_args, proxy_args=proxy_args,
                     internal_token=sizes.internal_token, **common)
