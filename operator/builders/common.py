"""Names, labels and metadata shared by every child of an AgentServing resource."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from agentserving.core.hashing import ENGINE_HASH_SCHEMES, HashScheme

API_VERSION = "agentserving.io/v1alpha1"
KIND = "AgentServing"

NAME_LABEL = "app.kubernetes.io/name"
INSTANCE_LABEL = "app.kubernetes.io/instance"
COMPONENT_LABEL = "app.kubernetes.io/component"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
PART_OF_LABEL = "app.kubernetes.io/part-of"
MANAGED_BY = "agentserving-operator"
CONFIG_HASH_ANNOTATION = "agentserving.io/config-hash"

# Ports of DESIGN.md.
WORKER_PORT = 8000
MEMORY_PORT_START = 6999  # the API process; engine process k listens on MEMORY_PORT_START + 1 + k
PROXY_PORT = 8080
KVINDEX_PORT = 8300
# The kvindex as LMCache's controller (vLLM-Ascend pods): workers PUSH to 8301, ask on 8302.
LMCACHE_CONTROLLER_PORT = 8301
LMCACHE_WORKER_PORT_START = 7200  # LMCache's controller-facing port of TP rank k: 7200 + k
REDIS_PORT = 6379
# The KV server that carries vLLM pods' P/D hand-off (``agentserving kvserver``): LMCache's
# protocol (lm://) on 65432, its HTTP API (health, metrics, evictions) on 65433. A central one
# (kvCache.transferBackend lmcache-server) or one in every vLLM pod (p2p).
KVSERVER_PORT = 65432
KVSERVER_API_PORT = 65433
KVCACHE_DIR = "/kvcache"
CONFIG_DIR = "/etc/agentserving"

POOLS = ("prefill", "decode")


class SpecError(ValueError):
    """The spec passed the CRD's schema but cannot be served as written (a cross-field rule)."""

    def __init__(self, field_path: str, message: str):
        super().__init__(f"{field_path}: {message}")
        self.field_path = field_path


# Per engine, what the CRD leaves unset: the reference worker schedules with Longcap-FCFS and
# Dynamic Chunk under the ShadowScheduler; vLLM pods have only vLLM's own FCFS scheduler and no
# ShadowScheduler (so `engine: vllm` alone is servable).
ENGINE_SCHEDULER_POLICIES = {"reference": "longcap-dynamic", "vllm": "fcfs",
                             "vllm-ascend": "fcfs"}
ENGINE_PREFETCH_POLICIES = {"reference": "shadow-scheduler", "vllm": "none",
                            "vllm-ascend": "none"}
DEFAULT_LOOKAHEAD = 5
# The kvCache.transferBackend values with which each engine's P/D hand-off actually moves KV
# (the first is its default): the reference worker's decode pod pulls it from the prefill pod
# (tcp), LMCache-Ascend's producer/consumer connector sends it itself (tcp), and a vLLM pod's
# LMCache moves it only through a KV server: its own, which the decode pod pulls from (p2p), or
# a central one (lmcache-server) -- on tcp a vLLM decode pod would silently recompute every
# prompt.
ENGINE_TRANSFER_BACKENDS = {"reference": ("tcp",), "vllm": ("p2p", "lmcache-server"),
                            "vllm-ascend": ("tcp",)}


def with_engine_defaults(spec: dict[str, Any]) -> dict[str, Any]:
    """The spec with the defaults that depend on other fields (the CRD's are per field)."""
    engine = (spec.get("engine") or {}).get("type", "reference")
    kv = dict(spec.get("kvCache") or {})
    if not kv.get("hashScheme"):
        kv["hashScheme"] = ENGINE_HASH_SCHEMES.get(engine, HashScheme.BLAKE3).value
    if not kv.get("transferBackend"):
        kv["transferBackend"] = ENGINE_TRANSFER_BACKENDS.get(engine, ("tcp",))[0]
    prefetch = dict(kv.get("prefetch") or {})
    prefetch.setdefault("policy", ENGINE_PREFETCH_POLICIES.get(engine, "none"))
    if prefetch["policy"] == "shadow-scheduler":
        prefetch.setdefault("lookahead", DEFAULT_LOOKAHEAD)
    kv["prefetch"] = prefetch
    out = {**spec, "kvCache": kv}
    for role in POOLS:
        pool = dict(spec.get(role) or {})
        pool.setdefault("schedulerPolicy", ENGINE_SCHEDULER_POLICIES.get(engine, "fcfs"))
        out[role] = pool
    return out


@dataclass(frozen=True)
class Instance:
    """One AgentServing resource as the builders see it (spec defaulted by the CRD, then by
    ``with_engine_defaults``)."""

    name: str
    namespace: str
    uid: str
    spec: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "spec", with_engine_defaults(self.spec))

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> Instance:
        meta = body["metadata"]
        return cls(meta["name"], meta["namespace"], meta["uid"], dict(body.get("spec") or {}))

    def child_name(self, component: str) -> str:
        return f"{self.name}-{component}"

    def service_host(self, component: str) -> str:
        return f"{self.child_name(component)}.{self.namespace}.svc"


def selector_labels(inst: Instance, component: str) -> dict[str, str]:
    return {NAME_LABEL: "agentserving", INSTANCE_LABEL: inst.name, COMPONENT_LABEL: component}


def labels(inst: Instance, component: str) -> dict[str, str]:
    return {**selector_labels(inst, component), MANAGED_BY_LABEL: MANAGED_BY,
            PART_OF_LABEL: "agentserving"}


def selector_string(inst: Instance, component: str) -> str:
    return ",".join(f"{k}={v}" for k, v in selector_labels(inst, component).items())


def owner_reference(inst: Instance) -> dict[str, Any]:
    return {"apiVersion": API_VERSION, "kind": KIND, "name": inst.name, "uid": inst.uid,
            "controller": True, "blockOwnerDeletion": True}


def metadata(inst: Instance, component: str, name: str | None = None) -> dict[str, Any]:
    return {
        "name": name or inst.child_name(component),
        "namespace": inst.namespace,
        "labels": labels(inst, component),
        "ownerReferences": [owner_reference(inst)],
    }


def content_hash(data: Any) -> str:
    """A short, stable hash of JSON-able data (pod template annotations that roll pods)."""
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def env_var(name: str, value: Any) -> dict[str, Any]:
    return {"name": name, "value": str(value)}


def field_env(name: str, field_path: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": field_path}}}


def http_probe(path: str, port: int | str, period: int = 10, failures: int = 3) -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": port}, "periodSeconds": period,
            "failureThreshold": failures, "timeoutSeconds": 2}
