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


def reference_worker(ctx: WorkerContext) -> dict[str, Any]:
    """AgentServing's own worker (transformers + LMCache), for every accelerator type."""
    kv = ctx.kv
    command = [
        "agentserving", "worker",
        "--role", ctx.role,
        "--port", str(WORKER_PORT),
        "--memory-port-start", str(MEMORY_PORT_START),
        "--model", ctx.model["name"],
        "--pod-name", "$(POD_NAME)",
        "--kvindex", ctx.kvindex_url,
        "--cpu-cache-gib", str(kv["cpuGiB"]),
        "--disk-cache-dir", KVCACHE_DIR,
        "--disk-cache-gib", str(kv["diskGiB"]),
        "--chunk-size", str(kv["chunkSize"]),
        "--hash-scheme", kv["hashScheme"],
    ]
    return _container(ctx, command + list(ctx.engine.get("args") or []), "/healthz")


def vllm_worker(ctx: WorkerContext) -> dict[str, Any]:
    """vLLM (or vLLM-Ascend) with LMCache as its KV connector. Issue 10 refines this."""
    kv_transfer = {
        "kv_connector": "LMCacheConnectorV1",
        "kv_role": "kv_producer" if ctx.role == "prefill" else "kv_consumer",
        "kv_connector_extra_config": {
            "transfer_backend": ctx.kv["transferBackend"],
            "kvindex_url": ctx.kvindex_url,
            "memory_port_start": MEMORY_PORT_START,
        },
    }
    command = [
        "vllm", "serve", ctx.model["name"],
        "--host", "0.0.0.0",
        "--port", str(WORKER_PORT),
        "--served-model-name", ctx.served_name,
        "--tensor-parallel-size", str(ctx.tensor_parallel),
        "--kv-transfer-config", json.dumps(kv_transfer, sort_keys=True),
    ]
    if ctx.model.get("maxContext"):
        command += ["--max-model-len", str(ctx.model["maxContext"])]
    if ctx.model.get("source") == "dummy":
        command += ["--load-format", "dummy"]
    container = _container(ctx, command + list(ctx.engine.get("args") or []), "/health")
    container["env"] += [
        env_var("LMCACHE_CHUNK_SIZE", ctx.kv["chunkSize"]),
        env_var("LMCACHE_USE_EXPERIMENTAL", "True"),
        env_var("AGENTSERVING_KVINDEX_URL", ctx.kvindex_url),
    ]
    return container


ContainerBuilder = Callable[[WorkerContext], dict[str, Any]]

# engine type (spec.engine.type) -> container builder
ENGINES: dict[str, ContainerBuilder] = {
    "reference": reference_worker,
    "vllm": vllm_worker,
    "vllm-ascend": vllm_worker,
}
