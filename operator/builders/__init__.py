"""Pure builders: an AgentServing spec in, the desired child manifests out.

Nothing here talks to a cluster. ``build_children`` is the whole desired state of one
resource; the reconciler applies it (server-side apply) and prunes what is no longer in it.
Every child carries the resource's ownerReference, so deleting the resource garbage-collects
them all.
"""

from __future__ import annotations

from typing import Any

from ..settings import OperatorSettings
from .common import (
    KIND,
    KVINDEX_PORT,
    POOLS,
    PROXY_PORT,
    Instance,
    SpecError,
    content_hash,
    selector_string,
)
from .config import build_config, wants_config
from .credentials import derive_token, internal_secret_name, with_internal_token
from .engines import ENGINES, WorkerContext, validate_engine
from .kvserver import build_kvserver, wants_kvserver
from .pools import build_pool, build_pool_service, validate_pool
from .redis_ha import wants_sentinel
from .services import build_kvindex, build_proxy, build_redis, wants_redis

__all__ = [
    "ENGINES", "KIND", "MANAGED_KINDS", "POOLS", "Instance", "SpecError", "WorkerContext",
    "build_children", "derive_token", "endpoint", "internal_secret_name",
    "kvindex_service_url", "selector_string", "worker_image", "workloads",
]

# (apiVersion, kind) of everything build_children may return; the reconciler prunes these.
MANAGED_KINDS = (("v1", "ConfigMap"), ("v1", "Service"), ("apps/v1", "StatefulSet"),
                 ("apps/v1", "Deployment"))


def worker_image(inst: Instance, settings: OperatorSettings) -> str:
    engine = inst.spec["engine"]
    if engine.get("image"):
        return engine["image"]
    return {"vllm": settings.vllm_image, "vllm-ascend": settings.vllm_ascend_image}.get(
        engine["type"], settings.image("worker"))


def kvindex_service_url(inst: Instance) -> str:
    """The kvindex as the pods reach it (in-cluster DNS)."""
    return f"http://{inst.service_host('kvindex')}:{KVINDEX_PORT}"


def endpoint(inst: Instance) -> str:
    """The proxy's OpenAI-compatible base URL inside the cluster."""
    return f"http://{inst.service_host('proxy')}:{PROXY_PORT}/v1"


def workloads(inst: Instance) -> dict[str, tuple[str, str]]:
    """component -> (kind, name) of the workload whose readiness the status reports."""
    out = {role: ("StatefulSet", inst.child_name(role)) for role in POOLS}
    out["proxy"] = ("Deployment", inst.child_name("proxy"))
    out["kvindex"] = ("Deployment", inst.child_name("kvindex"))
    if wants_redis(inst):  # with Sentinel (2+ members) a StatefulSet of the same name
        out["redis"] = ("StatefulSet" if wants_sentinel(inst) else "Deployment",
                        inst.child_name("redis"))
    if wants_kvserver(inst):
        out["kvserver"] = ("Deployment", inst.child_name("kvserver"))
    return out


def build_children(inst: Instance, settings: OperatorSettings) -> list[dict[str, Any]]:
    """Every child object of one AgentServing resource. Raises SpecError for a spec that
    the schema admits but that cannot be served (e.g. two in-memory kvindex replicas).
    With the operator's token key, the children include the resource's internal token
    (``credentials``) and every AgentServing container reads it; without one, no component
    checks credentials."""
    if inst.spec["engine"]["type"] not in ENGINES:
        raise SpecError("spec.engine.type", f"unknown engine {inst.spec['engine']['type']!r}")
    kvindex_url = kvindex_service_url(inst)
    image = worker_image(inst, settings)
    for role in POOLS:  # every pool's own rules first, then the engine's cross-field ones
        validate_pool(inst, role)
    validate_engine(inst.spec)
    children: list[dict[str, Any]] = []
    config_hash = None
    if wants_config(inst.spec):
        config = build_config(inst)
        config_hash = content_hash(config["data"])
        children.append(config)
    for role in POOLS:
        children.append(build_pool(inst, role, image, kvindex_url, config_hash,
                                   settings.image("worker")))
        children.append(build_pool_service(inst, role))
    children += build_kvindex(inst, settings.image("kvindex"))
    children += build_proxy(inst, settings.image("proxy"), kvindex_url)
    if wants_redis(inst):
        children += build_redis(inst, settings.redis_image)
    if wants_kvserver(inst):
        children += build_kvserver(inst, image)
    if not settings.token_key:
        return children
    token = derive_token(settings.token_key, inst.namespace, inst.name, inst.uid)
    return with_internal_token(inst, token, children)
