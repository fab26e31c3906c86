"""The ConfigMap vLLM workers mount at /etc/agentserving: LMCache's configuration file."""

from __future__ import annotations

from typing import Any

import yaml

from .common import (
    CONFIG_DIR,
    KVCACHE_DIR,
    LMCACHE_CONTROLLER_PORT,
    LMCACHE_WORKER_PORT_START,
    MEMORY_PORT_START,
    Instance,
    metadata,
)


def wants_config(spec: dict[str, Any]) -> bool:
    """Whether the pods' engine reads the ConfigMap: LMCache inside vLLM reads lmcache.yaml
    (LMCACHE_CONFIG_FILE); the reference worker configures its LMCache store from its own
    flags, so its pods mount nothing."""
    return spec["engine"]["type"] in ("vllm", "vllm-ascend")


def lmcache_settings(inst: Instance) -> dict[str, Any]:
    """LMCache's own configuration file (lmcache.yaml): the CPU and local-disk tiers, and per
    vLLM flavour who serves the memory API and who tells the kvindex about residency:

    - vllm: AgentServing's connector serves the memory API on 6999 + offsets itself and reports
      residency to the kvindex; LMCache's internal API server stays off (it would take the
      same ports) and so does its controller (a second reporter for the same pod would fight
      over the pod's batch sequence).
    - vllm-ascend: LMCache-Ascend's internal API server carries the memory API
      (``enable_chunk_hashes_return`` turns on /memory/prefetch, /memory/evict and the
      chunk_hashes return) and its controller reports residency to the kvindex (ZMQ, the
      kvindex's LMCache controller endpoint); the pod's registration comes from the
      registrar sidecar (engine/vllm/registrar.py)."""
    kv = inst.spec["kvCache"]
    settings: dict[str, Any] = {
        "chunk_size": kv["chunkSize"],
        "local_cpu": True,
        "max_local_cpu_size": float(kv["cpuGiB"]),
        "save_unfull_chunk": False,
        "enable_async_loading": True,
    }
    if kv["diskGiB"] > 0:
        settings["local_disk"] = f"file://{KVCACHE_DIR}/"
        settings["max_local_disk_size"] = float(kv["diskGiB"])
        if kv.get("diskIO") == "direct":  # chunk files read and written with O_DIRECT
            settings["extra_config"] = {"use_odirect": True}
    if inst.spec["engine"]["type"] == "vllm":
        settings["internal_api_server_enabled"] = False
    if inst.spec["engine"]["type"] == "vllm-ascend":
        # LMCache-Ascend's memory API: the scheduler process on 6999, worker k on 6999 + 1 + k
        # (seed 000, section 4.3), with the chunk_hashes return.
        settings["internal_api_server_enabled"] = True
        settings["internal_api_server_host"] = "0.0.0.0"
        settings["internal_api_server_port_start"] = MEMORY_PORT_START
        settings["enable_chunk_hashes_return"] = True
        settings["lookup_hashes_cache_size"] = 4096
        # the kvindex as LMCache's controller; lmcache_instance_id is the pod name, set per
        # pod by the LMCACHE_LMCACHE_INSTANCE_ID environment variable
        host = inst.service_host("kvindex")
        settings["enable_controller"] = True
        settings["controller_pull_url"] = f"{host}:{LMCACHE_CONTROLLER_PORT}"
        settings["controller_reply_url"] = f"{host}:{LMCACHE_CONTROLLER_PORT + 1}"
        settings["lmcache_instance_id"] = "agentserving"  # placeholder: the env wins
        tp = max(int(inst.spec[p].get("tensorParallelSize", 1)) for p in ("prefill", "decode"))
        settings["lmcache_worker_ports"] = [LMCACHE_WORKER_PORT_START + k for k in range(tp)]
    return settings


def uses_lmcache_controller(inst: Instance) -> bool:
    """Whether the kvindex must act as LMCache's controller (its workers report to it)."""
    return inst.spec["engine"]["type"] == "vllm-ascend"


def build_config(inst: Instance) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata(inst, "config"),
        "data": {"lmcache.yaml": yaml.safe_dump(lmcache_settings(inst), sort_keys=True)},
    }


LMCACHE_CONFIG_FILE = f"{CONFIG_DIR}/lmcache.yaml"
