"""The KV server that carries a vLLM pod's P/D hand-off (``agentserving kvserver``, in the
vLLM image): LMCache's protocol on 65432, its HTTP API (readiness, metrics, evictions) on
65433, least recently used chunks evicted past ``kvCache.transferGiB``.

``kvCache.transferBackend`` decides where it runs:

- ``p2p``: one in every vLLM pod, a second container beside the worker. The worker hands KV
  to its own server over loopback; a prefill answer names that server at the pod's address,
  and the decode pod's ranks read the named chunks from there into their DRAM tier. No
  central server: the hand-off's capacity grows with the pools, and no one server carries
  every prompt.
- ``lmcache-server``: one central Deployment and Service, which every vLLM pod writes to and
  reads from.
"""

from __future__ import annotations

import math
from typing import Any

from .common import (
    KVSERVER_API_PORT,
    KVSERVER_PORT,
    Instance,
    SpecError,
    http_probe,
    labels,
    metadata,
    selector_labels,
)

LOOPBACK = "127.0.0.1"
# What the server holds beyond its chunks, MiB: the interpreter with torch (LMCache's
# protocol module imports it, ~330 MiB idle) and buffers in flight.
OVERHEAD_MIB = 512


def backend(spec: dict[str, Any]) -> str:
    return spec["kvCache"]["transferBackend"]


def wants_kvserver(inst: Instance) -> bool:
    """A central KV server (a Deployment and its Service)."""
    return backend(inst.spec) == "lmcache-server"


def wants_kv_sidecar(spec: dict[str, Any]) -> bool:
    """A KV server in every vLLM pod (p2p is refused for the other engines)."""
    return spec["engine"]["type"] == "vllm" and backend(spec) == "p2p"


def transfer_gib(spec: dict[str, Any]) -> float:
    """``kvCache.transferGiB``, checked here as well as by the CRD: a cluster that still runs
    an older CRD stores whatever it is given."""
    gib = spec["kvCache"].get("transferGiB")
    if isinstance(gib, bool) or not isinstance(gib, (int, float)) or not gib > 0 \
            or not math.isfinite(gib):
        raise SpecError("spec.kvCache.transferGiB", f"{gib!r}: a number of GiB above 0")
    return gib


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


def kvserver_argv(spec: dict[str, Any]) -> list[str]:
    """``agentserving kvserver`` bound to ``kvCache.transferGiB`` on every interface (a
    sidecar's peers reach it at the pod's address, a central one's through its Service)."""
    return ["agentserving", "kvserver", "--host", "0.0.0.0", "--port", str(KVSERVER_PORT),
            "--api-port", str(KVSERVER_API_PORT), "--max-gib", _number(transfer_gib(spec))]


def kvserver_resources(spec: dict[str, Any]) -> dict[str, Any]:
    """A little CPU, and the memory its bound needs: a limit below ``transferGiB`` would have
    the kernel kill the server before it evicts anything."""
    memory = f"{math.ceil(transfer_gib(spec) * 1024) + OVERHEAD_MIB}Mi"
    return {"requests": {"cpu": "100m", "memory": memory}, "limits": {"memory": memory}}


def _ports() -> list[dict[str, Any]]:
    return [{"name": "lm", "containerPort": KVSERVER_PORT, "protocol": "TCP"},
            {"name": "kv-api", "containerPort": KVSERVER_API_PORT, "protocol": "TCP"}]


def _container(spec: dict[str, Any], image: str) -> dict[str, Any]:
    container = {
        "name": "kvserver",
        "image": image,
        "command": kvserver_argv(spec),
        "ports": _ports(),
        "readinessProbe": http_probe("/healthz", "kv-api", period=5),
        "livenessProbe": http_probe("/healthz", "kv-api", period=20),
        "resources": kvserver_resources(spec),
    }
    if spec["engine"].get("imagePullPolicy"):  # the engine's image, pulled as the engine's is
        container["imagePullPolicy"] = spec["engine"]["imagePullPolicy"]
    return container


def worker_kv_values(inst: Instance) -> dict[str, Any]:
    """The ``agentserving worker`` settings that point a vLLM pod at its KV server: its
    LMCache remote (``--kv-transfer-url``), the server's HTTP API (``--kv-server-api``, where
    the pod's evictions reach it) and, with p2p, ``--kv-transfer-p2p``. Empty for the
    engines whose hand-off needs no KV server."""
    if wants_kv_sidecar(inst.spec):
        return {"kv_transfer_url": f"lm://{LOOPBACK}:{KVSERVER_PORT}",
                "kv_server_api": f"http://{LOOPBACK}:{KVSERVER_API_PORT}",
                "kv_transfer_p2p": True}
    if wants_kvserver(inst):
        host = inst.service_host("kvserver")
        return {"kv_transfer_url": f"lm://{host}:{KVSERVER_PORT}",
                "kv_server_api": f"http://{host}:{KVSERVER_API_PORT}"}
    return {}


def kvserver_sidecar(spec: dict[str, Any], image: str) -> dict[str, Any]:
    """The pod's own KV server (p2p), in the worker's image."""
    return _container(spec, image)


def build_kvserver(inst: Instance, image: str) -> list[dict[str, Any]]:
    """The central KV server (lmcache-server): one replica, replaced rather than doubled
    (two would split the hand-off between them)."""
    if inst.spec["engine"]["type"] != "vllm":
        raise SpecError("spec.kvCache.transferBackend",
                        "lmcache-server carries the P/D hand-off of engine vllm only")
    component = "kvserver"
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata(inst, component),
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": selector_labels(inst, component)},
            "strategy": {"type": "Recreate"},
            "template": {
                "metadata": {"labels": labels(inst, component)},
                "spec": {"containers": [_container(inst.spec, image)],
                         "enableServiceLinks": False},
            },
        },
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(inst, component),
        "spec": {
            "type": "ClusterIP",
            "selector": selector_labels(inst, component),
            "ports": [{"name": p["name"], "port": p["containerPort"],
                       "targetPort": p["containerPort"], "protocol": "TCP"} for p in _ports()],
        },
    }
    return [deployment, service]
