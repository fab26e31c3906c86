"""The ConfigMap every worker mounts at /etc/agentserving: engine and LMCache settings."""

from __future__ import annotations

from typing import Any

import yaml

from .common import CONFIG_DIR, KVCACHE_DIR, MEMORY_PORT_START, Instance, metadata


def engine_settings(inst: Instance, kvindex_url: str) -> dict[str, Any]:
    """The deployment-wide settings every worker reads (agentserving.yaml). Per-pool settings
    (tensor parallel, scheduler policy) go into each pool's own pod template instead, so
    changing one pool never rolls the other."""
    spec = inst.spec
    model, kv = spec["model"], spec["kvCache"]
    return {
        "model": {
            "name": model["name"],
            "source": model.get("source", ""),
            "servedName": model.get("servedName") or model["name"],
            "maxContext": model.get("maxContext"),
        },
        "engine": spec["engine"]["type"],
        "kvindex": kvindex_url,
        "kvCache": {
            "chunkSize": kv["chunkSize"],
            "hashScheme": kv["hashScheme"],
            "cpuGiB": kv["cpuGiB"],
            "diskGiB": kv["diskGiB"],
            "diskDir": KVCACHE_DIR,
            "transferBackend": kv["transferBackend"],
            "prefetch": {"policy": kv["prefetch"]["policy"],
                         "lookahead": kv["prefetch"]["lookahead"]},
        },
    }


def lmcache_settings(inst: Instance) -> dict[str, Any]:
    """LMCache's own configuration file (lmcache.yaml): the CPU and local-disk tiers."""
    kv = inst.spec["kvCache"]
    settings: dict[str, Any] = {
        "chunk_size": kv["chunkSize"],
        "local_cpu": kv["cpuGiB"] > 0,
        "max_local_cpu_size": float(kv["cpuGiB"]),
        "save_unfull_chunk": False,
        "enable_async_loading": True,
    }
    if kv["diskGiB"] > 0:
        settings["local_disk"] = f"file://{KVCACHE_DIR}/"
        settings["max_local_disk_size"] = float(kv["diskGiB"])
    if inst.spec["engine"]["type"] in ("vllm", "vllm-ascend"):
        # LMCache's internal API server carries the memory API (/memory/prefetch, /evict):
        # the scheduler process on 6999, worker k on 6999 + 1 + k (seed 000, section 4.3).
        settings["internal_api_server_enabled"] = True
        settings["internal_api_server_host"] = "0.0.0.0"
        settings["internal_api_server_port_start"] = MEMORY_PORT_START
    return settings


def build_config(inst: Instance, kvindex_url: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata(inst, "config"),
        "data": {
            "agentserving.yaml": yaml.safe_dump(engine_settings(inst, kvindex_url), sort_keys=True),
            "lmcache.yaml": yaml.safe_dump(lmcache_settings(inst), sort_keys=True),
        },
    }


CONFIG_FILE = f"{CONFIG_DIR}/agentserving.yaml"
LMCACHE_CONFIG_FILE = f"{CONFIG_DIR}/lmcache.yaml"
