"""The proxy, the kvindex and (when asked) an in-cluster Redis: a Deployment and a Service each
(a Redis of 2+ members is a StatefulSet with Sentinel: ``redis_ha``; the vLLM pods' KV server:
``kvserver``).

The proxy's and the kvindex's command lines are rendered from their own settings objects
through their own click commands (``core.argv``), as the workers' are.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ValidationError

from agentserving.core.argv import settings_argv
from agentserving.kvindex.cli import command as kvindex_command
from agentserving.kvindex.settings import KvindexSettings
from agentserving.proxy.cli import command as proxy_command
from agentserving.proxy.settings import ENGINE_PROXY_SETTINGS, ProxySettings

from .common import (
    KVINDEX_PORT,
    LMCACHE_CONTROLLER_PORT,
    PROXY_PORT,
    REDIS_PORT,
    Instance,
    SpecError,
    http_probe,
    labels,
    metadata,
    selector_labels,
)
from .config import uses_lmcache_controller
from .redis_ha import build_redis_sentinel, redis_replicas, sentinel_store_url


def kvindex_store(inst: Instance) -> str:
    """The kvindex's --store: an external Redis, the in-cluster one, or memory."""
    kvi = inst.spec["kvindex"]
    redis = kvi.get("redis") or {}
    if redis.get("url") and redis.get("inCluster"):
        raise SpecError("spec.kvindex.redis", "set either url or inCluster, not both")
    members = redis_replicas(inst)
    if redis.get("url"):
        return redis["url"]
    if redis.get("inCluster"):
        if members > 1:
            return sentinel_store_url(inst)
        return f"redis://{inst.service_host('redis')}:{REDIS_PORT}/0"
    if kvi["replicas"] > 1:
        raise SpecError("spec.kvindex.replicas",
                        "more than one kvindex replica needs Redis (redis.url or redis.inCluster)")
    return "memory"


def wants_redis(inst: Instance) -> bool:
    return bool((inst.spec["kvindex"].get("redis") or {}).get("inCluster"))


def _deployment(inst: Instance, component: str, replicas: int, container: dict[str, Any],
                strategy: str = "RollingUpdate") -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata(inst, component),
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": selector_labels(inst, component)},
            "strategy": {"type": strategy},
            "template": {
                "metadata": {"labels": labels(inst, component)},
                "spec": {"containers": [container], "enableServiceLinks": False},
            },
        },
    }


def _service(inst: Instance, component: str, port: int,
             service_type: str = "ClusterIP", port_name: str = "http") -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(inst, component),
        "spec": {
            "type": service_type,
            "selector": selector_labels(inst, component),
            "ports": [{"name": port_name, "port": port, "targetPort": port,
                       "protocol": "TCP"}],
        },
    }


def _argv(subcommand: str, command: Any, settings_cls: type[BaseModel], where: str,
          values: dict[str, Any]) -> list[str]:
    """``agentserving SUBCOMMAND`` with ``values``, validated by the service's settings."""
    try:
        return ["agentserving", subcommand, *settings_argv(command, settings_cls, values)]
    except ValidationError as exc:
        raise SpecError(where, f"the {subcommand} refuses it: {exc.errors()[0]['msg']}") from exc


def kvindex_min_acks(inst: Instance) -> int:
    """Replicas that must hold each write (Redis WAIT): ``redis.minAcks``, else 1 with the
    in-cluster Redis with Sentinel (a failover then loses nothing acknowledged), else 0."""
    redis = inst.spec["kvindex"].get("redis") or {}
    members = redis_replicas(inst)
    min_acks = redis.get("minAcks")
    if members > 1:
        if min_acks is None:
            return 1
        if min_acks > members - 1:
            raise SpecError("spec.kvindex.redis.minAcks",
                            f"at most {members - 1} (redis.replicas - 1) replicas can "
                            f"acknowledge a write, not {min_acks}")
    return min_acks or 0


def kvindex_argv(inst: Instance) -> list[str]:
    values: dict[str, Any] = {"host": "0.0.0.0", "port": KVINDEX_PORT,
                              "store": kvindex_store(inst)}
    min_acks = kvindex_min_acks(inst)
    if min_acks:
        values["redis_min_acks"] = min_acks
    if uses_lmcache_controller(inst):
        # LMCache(-Ascend) workers report their chunks here (PULL) and register (ROUTER, +1)
        values["lmcache_controller"] = f"tcp://0.0.0.0:{LMCACHE_CONTROLLER_PORT}"
    return _argv("kvindex", kvindex_command, KvindexSettings, "spec.kvindex", values)


# spec.proxy's fields that are the proxy's own settings (unset: what agentserving runs in front
# of the engine, ENGINE_PROXY_SETTINGS, else the proxy's default)
PROXY_FIELDS = {"localPrefillTokens": "local_prefill_tokens", "admitPerPod": "admit_per_pod",
                "maxPrefillBacklog": "max_prefill_backlog"}


def proxy_argv(inst: Instance, kvindex_url: str) -> list[str]:
    proxy = inst.spec["proxy"]
    values: dict[str, Any] = {"host": "0.0.0.0", "port": PROXY_PORT, "kvindex_url": kvindex_url,
                              "routing": proxy["routing"],
                              # the kvindex scores prefixes in chunks of the workers' size
                              "chunk_size": inst.spec["kvCache"]["chunkSize"]}
    engine_defaults = ENGINE_PROXY_SETTINGS.get(inst.spec["engine"]["type"], {})
    for field, setting in PROXY_FIELDS.items():
        value = proxy.get(field)
        if value is None:
            value = engine_defaults.get(setting)
        if value is not None:
            values[setting] = value
    if proxy["replicas"] > 1:  # a Service spreads a session's turns over the replicas
        values["shared_sessions"] = True
    return _argv("proxy", proxy_command, ProxySettings, "spec.proxy", values)


def build_kvindex(inst: Instance, image: str) -> list[dict[str, Any]]:
    kvi = inst.spec["kvindex"]
    store = kvindex_store(inst)
    container: dict[str, Any] = {
        "name": "kvindex",
        "image": kvi.get("image") or image,
        "command": kvindex_argv(inst),
        "ports": [{"name": "http", "containerPort": KVINDEX_PORT, "protocol": "TCP"}],
        "readinessProbe": http_probe("/readyz", "http", period=5),
        "livenessProbe": http_probe("/healthz", "http", period=10),
    }
    if kvi.get("resources"):
        container["resources"] = dict(kvi["resources"])
    service = _service(inst, "kvindex", KVINDEX_PORT)
    if uses_lmcache_controller(inst):
        for name, port in (("lmcache-pull", LMCACHE_CONTROLLER_PORT),
                           ("lmcache-reply", LMCACHE_CONTROLLER_PORT + 1)):
            container["ports"].append({"name": name, "containerPort": port, "protocol": "TCP"})
            service["spec"]["ports"].append({"name": name, "port": port, "targetPort": port,
                                             "protocol": "TCP"})
    # An in-memory index cannot have two writers: replace it, never run two side by side.
    strategy = "Recreate" if store == "memory" else "RollingUpdate"
    return [_deployment(inst, "kvindex", kvi["replicas"], container, strategy), service]


def build_proxy(inst: Instance, image: str, kvindex_url: str) -> list[dict[str, Any]]:
    proxy = inst.spec["proxy"]
    container: dict[str, Any] = {
        "name": "proxy",
        "image": proxy.get("image") or image,
        "command": proxy_argv(inst, kvindex_url),
        "ports": [{"name": "http", "containerPort": PROXY_PORT, "protocol": "TCP"}],
        # Ready once it knows at least one worker pod (from the kvindex).
        "readinessProbe": http_probe("/readyz", "http", period=5),
        "livenessProbe": http_probe("/healthz", "http", period=10),
    }
    if proxy.get("resources"):
        container["resources"] = dict(proxy["resources"])
    return [_deployment(inst, "proxy", proxy["replicas"], container),
            _service(inst, "proxy", PROXY_PORT, proxy["serviceType"])]


def build_redis(inst: Instance, image: str) -> list[dict[str, Any]]:
    redis = inst.spec["kvindex"].get("redis") or {}
    if redis_replicas(inst) > 1:
        return build_redis_sentinel(inst, redis.get("image") or image)
    container = {
        "name": "redis",
        "image": redis.get("image") or image,
        "args": ["--save", "", "--appendonly", "no"],
        "ports": [{"name": "redis", "containerPort": REDIS_PORT, "protocol": "TCP"}],
        "readinessProbe": {"tcpSocket": {"port": REDIS_PORT}, "periodSeconds": 5},
    }
    return [_deployment(inst, "redis", 1, container, "Recreate"),
            _service(inst, "redis", REDIS_PORT, port_name="redis")]
