"""The prefill and decode pools: a StatefulSet (stable pod names, which the kvindex keys
residency by) and a headless Service each."""

from __future__ import annotations

import copy
from typing import Any

from agentserving.prefill.policies import SCHEDULER_POLICY_NAMES as VLLM_SCHEDULER_POLICIES

from .common import (
    CONFIG_DIR,
    CONFIG_HASH_ANNOTATION,
    KVCACHE_DIR,
    MEMORY_PORT_START,
    WORKER_PORT,
    Instance,
    SpecError,
    labels,
    metadata,
    selector_labels,
)
from .engines import ENGINES, WorkerContext, engine_volumes, registrar_sidecar
from .kvserver import kvserver_sidecar, wants_kv_sidecar, worker_kv_values

# accelerator type -> the extended resource its device plugin advertises (overridable per pool)
DEFAULT_RESOURCE_NAMES = {"nvidia": "nvidia.com/gpu", "ascend": "huawei.com/ascend-1980"}


def accelerator_resources(pool: dict[str, Any]) -> dict[str, Any]:
    """The pod's resources: the pool's own requests/limits plus its accelerators."""
    resources = copy.deepcopy(pool.get("resources") or {})
    acc = pool["accelerator"]
    if acc["type"] != "cpu" and acc["count"] > 0:
        name = acc.get("resourceName") or DEFAULT_RESOURCE_NAMES[acc["type"]]
        resources.setdefault("limits", {})[name] = str(acc["count"])
        resources.setdefault("requests", {})[name] = str(acc["count"])
    return resources


def validate_pool(inst: Instance, role: str) -> None:
    engine = inst.spec["engine"]["type"]
    pool = inst.spec[role]
    acc = pool["accelerator"]
    if engine == "vllm-ascend" and acc["type"] != "ascend":
        raise SpecError(f"spec.{role}.accelerator.type",
                        f"engine vllm-ascend needs ascend accelerators, not {acc['type']}")
    if engine == "vllm" and acc["type"] == "ascend":
        raise SpecError(f"spec.{role}.accelerator.type",
                        "ascend accelerators need engine vllm-ascend (or reference)")
    tp = pool["tensorParallelSize"]
    if engine == "reference" and tp > 1:
        raise SpecError(f"spec.{role}.tensorParallelSize",
                        "the reference engine has no tensor parallelism (vllm engines do)")
    if acc["type"] != "cpu" and tp > acc["count"]:
        raise SpecError(f"spec.{role}.tensorParallelSize",
                        f"{tp} ranks need as many accelerators per pod, not {acc['count']}")
    _validate_scheduler_policy(inst, role)


def _validate_scheduler_policy(inst: Instance, role: str) -> None:
    engine, policy = inst.spec["engine"]["type"], inst.spec[role]["schedulerPolicy"]
    prefetch = inst.spec["kvCache"]["prefetch"]["policy"]
    where = f"spec.{role}.schedulerPolicy"
    if engine == "vllm":
        if policy != "fcfs" and policy not in VLLM_SCHEDULER_POLICIES:
            raise SpecError(where, f"vllm pods run vLLM's own scheduler (fcfs) or one of "
                            f"{sorted(VLLM_SCHEDULER_POLICIES)} inside it")
    elif engine != "reference":
        if policy != "fcfs":
            raise SpecError(where, f"{engine} pods run vLLM's own scheduler: only fcfs")
        if inst.spec[role].get("chunkAlign"):
            raise SpecError(f"spec.{role}.chunkAlign", f"{engine} pods run vLLM's own "
                            "scheduler, which does not align chunks")
    elif policy == "fcfs" and prefetch == "shadow-scheduler":
        raise SpecError(where, "fcfs, the engine's built-in FCFS, cannot run under the "
                        "ShadowScheduler (kvCache.prefetch.policy shadow-scheduler): use "
                        "fcfs-chunk, or prefetch policy none")
    if policy == "shadow" and prefetch != "shadow-scheduler":
        raise SpecError(where, "shadow is the ShadowScheduler, which kvCache.prefetch.policy "
                        f"{prefetch} turns off: use its base policy, longcap-dynamic")


def _disk_volume(inst: Instance) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(pod volumes, volumeClaimTemplates) for the disk tier."""
    kv = inst.spec["kvCache"]
    vol = kv.get("diskVolume") or {}
    size = f"{max(int(kv['diskGiB']), 1)}Gi"
    if vol.get("storageClassName"):
        claim = {
            "metadata": {"name": "kvcache"},
            "spec": {"accessModes": ["ReadWriteOnce"], "storageClassName": vol["storageClassName"],
                     "resources": {"requests": {"storage": size}}},
        }
        return [], [claim]
    empty_dir: dict[str, Any] = {"sizeLimit": size}
    if vol.get("medium"):
        empty_dir["medium"] = vol["medium"]
    return [{"name": "kvcache", "emptyDir": empty_dir}], []


def build_pool(inst: Instance, role: str, image: str, kvindex_url: str,
               config_hash: str | None, agentserving_image: str = "") -> dict[str, Any]:
    """The pool's StatefulSet. ``config_hash``: the hash of the ConfigMap its engine reads
    (mounted at /etc/agentserving; a change rolls the pods), None for an engine that reads
    none."""
    validate_pool(inst, role)
    pool = inst.spec[role]
    ctx = WorkerContext(role=role, spec=inst.spec, image=image, kvindex_url=kvindex_url,
                        agentserving_image=agentserving_image,
                        kv_transfer=worker_kv_values(inst))
    container = ENGINES[inst.spec["engine"]["type"]](ctx)
    container["volumeMounts"] = [{"name": "kvcache", "mountPath": KVCACHE_DIR}]
    resources = accelerator_resources(pool)
    if resources:
        container["resources"] = resources
    volumes, claims = _disk_volume(inst)
    if config_hash is not None:
        container["volumeMounts"].append({"name": "config", "mountPath": CONFIG_DIR,
                                          "readOnly": True})
        volumes.append({"name": "config", "configMap": {"name": inst.child_name("config")}})
    if inst.spec["engine"]["type"] != "reference":  # vLLM: shared memory; Ascend: driver files
        extra_volumes, extra_mounts = engine_volumes(ctx)
        volumes += extra_volumes
        container["volumeMounts"] += extra_mounts
    containers = [container]
    if inst.spec["engine"]["type"] == "vllm-ascend":
        containers.append(registrar_sidecar(ctx))
    if wants_kv_sidecar(inst.spec):  # the pod's own KV server (p2p), in the worker's image
        containers.append(kvserver_sidecar(inst.spec, image))
    pod_spec: dict[str, Any] = {
        "containers": containers,
        "volumes": volumes,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": 30,
    }
    if pool.get("nodeSelector"):
        pod_spec["nodeSelector"] = dict(pool["nodeSelector"])
    if pool.get("tolerations"):
        pod_spec["tolerations"] = [dict(t) for t in pool["tolerations"]]
    if pool.get("schedulerName"):
        pod_spec["schedulerName"] = pool["schedulerName"]
    template_meta: dict[str, Any] = {"labels": labels(inst, role)}
    if config_hash is not None:
        template_meta["annotations"] = {CONFIG_HASH_ANNOTATION: config_hash}
    spec: dict[str, Any] = {
        "serviceName": inst.child_name(role),
        "replicas": pool["replicas"],
        # Workers are independent: start and replace them all at once, not one by one.
        "podManagementPolicy": "Parallel",
        "selector": {"matchLabels": selector_labels(inst, role)},
        "template": {"metadata": template_meta, "spec": pod_spec},
    }
    if claims:
        spec["volumeClaimTemplates"] = claims
    return {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": metadata(inst, role),
            "spec": spec}


def build_pool_service(inst: Instance, role: str) -> dict[str, Any]:
    """Headless: one DNS name per worker pod, for the KV hand-off and the memory API."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(inst, role),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": selector_labels(inst, role),
            "ports": [
                {"name": "http", "port": WORKER_PORT, "targetPort": "http", "protocol": "TCP"},
                {"name": "mem-api", "port": MEMORY_PORT_START, "targetPort": "mem-api",
                 "protocol": "TCP"},
            ],
        },
    }
