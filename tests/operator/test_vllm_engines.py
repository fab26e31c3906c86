"""The vLLM and vLLM-Ascend pods against seed 000: `vllm serve` with the LMCache connector in
--kv-transfer-config, kv_role per pool, the LMCache config file (chunk size, CPU and disk tiers,
internal API server on 6999), PYTHONHASHSEED, accelerators and the Ascend host mounts."""

from __future__ import annotations

import json

import pytest
import yaml

from agentserving.operator.builders import build_children
from agentserving.operator.builders.engines import WorkerContext, engine_volumes

from .operator_testing import EXAMPLES, defaulted, make_instance

ASCEND = {
    "model": {"name": "/mnt/sdb/models/GLM-4.7", "servedName": "glm4.7", "maxContext": 133000},
    "engine": {"type": "vllm-ascend"},
    "prefill": {"accelerator": {"type": "ascend", "count": 16}, "tensorParallelSize": 16},
    "decode": {"accelerator": {"type": "ascend", "count": 16}, "tensorParallelSize": 16},
    "kvCache": {"chunkSize": 256, "cpuGiB": 100, "diskGiB": 500,
                "hashScheme": "lmcache-builtin"},
}
NVIDIA = {
    "model": {"name": "Qwen/Qwen2.5-7B-Instruct"},
    "engine": {"type": "vllm"},
    "prefill": {"accelerator": {"type": "nvidia", "count": 1}},
    "decode": {"accelerator": {"type": "nvidia", "count": 1}},
    "kvCache": {"chunkSize": 512, "cpuGiB": 8, "diskGiB": 0, "hashScheme": "blake3"},
}


def children(spec, settings):
    return {(c["kind"], c["metadata"]["name"]): c
            for c in build_children(make_instance(spec), settings)}


def worker(kids, role):
    return kids[("StatefulSet", f"demo-{role}")]["spec"]["template"]["spec"]["containers"][0]


def flag(cmd, name):
    return cmd[cmd.index(name) + 1]


def env(container):
    return {e["name"]: e.get("value") for e in container["env"]}


@pytest.mark.parametrize("role,kv_role", [("prefill", "kv_producer"), ("decode", "kv_consumer")])
def test_ascend_command_matches_seed(settings, role, kv_role):
    c = worker(children(ASCEND, settings), role)
    cmd = c["command"]
    assert cmd[:3] == ["vllm", "serve", "/mnt/sdb/models/GLM-4.7"]
    # seed 000's flags
    assert flag(cmd, "--host") == "0.0.0.0"
    assert flag(cmd, "--tensor-parallel-size") == "16"
    assert flag(cmd, "--served-model-name") == "glm4.7"
    assert flag(cmd, "--max-model-len") == "133000"
    assert "--no-enable-prefix-caching" in cmd
    ktc = json.loads(flag(cmd, "--kv-transfer-config"))
    assert ktc["kv_connector"] == "LMCacheAscendConnectorV1Dynamic"
    assert ktc["kv_connector_module_path"] == \
        "lmcache_ascend.integration.vllm.lmcache_ascend_connector_v1"
    assert ktc["kv_role"] == kv_role
    assert ktc["kv_connector_extra_config"]["memory_port_start"] == 6999
    e = env(c)
    assert e["PYTHONHASHSEED"] == "0"  # seed: export PYTHONHASHSEED=0
    assert e["LMCACHE_CONFIG_FILE"] == "/etc/agentserving/lmcache.yaml"
    # memory API: scheduler on 6999, worker k on 7000 + k
    assert [p["containerPort"] for p in c["ports"]] == [8000, 6999] + list(range(7000, 7016))
    assert c["resources"]["limits"]["huawei.com/ascend-1980"] == "16"


def test_nvidia_command_and_resources(settings):
    kids = children(NVIDIA, settings)
    c = worker(kids, "decode")
    ktc = json.loads(flag(c["command"], "--kv-transfer-config"))
    assert ktc["kv_connector"] == "LMCacheConnectorV1" and "kv_connector_module_path" not in ktc
    assert ktc["kv_role"] == "kv_consumer"
    assert "PYTHONHASHSEED" not in env(c)  # blake3 does not depend on it
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"


def test_user_env_still_overrides_engine_env(settings):
    spec = {**ASCEND, "engine": {"type": "vllm-ascend",
                                 "env": [{"name": "PYTHONHASHSEED", "value": "7"}]}}
    c = worker(children(spec, settings), "prefill")
    names = [x["name"] for x in c["env"]]
    assert names[-1] == "PYTHONHASHSEED" and c["env"][-1]["value"] == "7"


def test_lmcache_config_file_has_tiers_and_memory_api(settings):
    from lmcache.v1.config import LMCacheEngineConfig

    data = yaml.safe_load(children(ASCEND, settings)[("ConfigMap", "demo-config")]["data"][
        "lmcache.yaml"])
    assert data["chunk_size"] == 256
    assert data["local_cpu"] is True and data["max_local_cpu_size"] == 100.0
    assert data["local_disk"] == "file:///kvcache/" and data["max_local_disk_size"] == 500.0
    assert data["internal_api_server_enabled"] is True
    assert data["internal_api_server_port_start"] == 6999
    # LMCache's own parser accepts every key the operator writes.
    cfg = LMCacheEngineConfig.from_dict(data)
    assert cfg.chunk_size == 256 and cfg.internal_api_server_port_start == 6999
    nv = yaml.safe_load(children(NVIDIA, settings)[("ConfigMap", "demo-config")]["data"][
        "lmcache.yaml"])
    assert "local_disk" not in nv and nv["chunk_size"] == 512
    ref = yaml.safe_load(children({"model": {"name": "m"}}, settings)[
        ("ConfigMap", "demo-config")]["data"]["lmcache.yaml"])
    assert "internal_api_server_enabled" not in ref  # the reference worker serves its own


def test_ascend_host_mounts_follow_seed():
    ctx = WorkerContext(role="prefill", spec=defaulted(ASCEND), image="i", kvindex_url="u")
    volumes, mounts = engine_volumes(ctx)
    paths = {m["mountPath"] for m in mounts}
    assert {"/dev/shm", "/etc/hccn.conf", "/usr/local/dcmi", "/usr/local/bin/npu-smi",
            "/usr/local/Ascend/driver/lib64", "/usr/local/Ascend/driver/version.info",
            "/etc/ascend_install.info", "/usr/bin/hccn_tool"} <= paths
    assert {v["name"] for v in volumes} == {m["name"] for m in mounts}
    nv = WorkerContext(role="prefill", spec=defaulted(NVIDIA), image="i", kvindex_url="u")
    assert [m["mountPath"] for m in engine_volumes(nv)[1]] == ["/dev/shm"]


def test_examples_render_their_engine(settings):
    seen = set()
    for path in EXAMPLES:
        body = yaml.safe_load(path.read_text())
        engine = body["spec"].get("engine", {}).get("type", "reference")
        if engine not in ("vllm", "vllm-ascend"):
            continue
        seen.add(engine)
        c = worker(children(body["spec"], settings), "prefill")
        assert c["command"][:2] == ["vllm", "serve"]
        assert json.loads(flag(c["command"], "--kv-transfer-config"))["kv_role"] == "kv_producer"
    assert seen == {"vllm", "vllm-ascend"}


def test_ascend_pods_mount_the_driver_and_accept_the_ascend_hash_scheme():
    from agentserving.operator.builders import build_children
    from agentserving.operator.settings import OperatorSettings

    inst = make_instance({"model": {"name": "Qwen/Qwen3-4B"}, "engine": {"type": "vllm-ascend"},
                          "kvCache": {"hashScheme": "lmcache-ascend"},
                          "prefill": {"accelerator": {"type": "ascend", "count": 1}},
                          "decode": {"accelerator": {"type": "ascend", "count": 1}}})
    children = build_children(inst, OperatorSettings())
    pool = next(c for c in children if c["kind"] == "StatefulSet"
                and c["metadata"]["name"].endswith("prefill"))
    pod = pool["spec"]["template"]["spec"]
    mounts = {m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
    assert "/dev/shm" in mounts and any("ascend" in m for m in mounts)
    assert {v["name"] for v in pod["volumes"]} >= {m["name"] for m in
                                                   pod["containers"][0]["volumeMounts"]}
    env = {e["name"]: e.get("value") for e in pod["containers"][0].get("env", [])}
    assert env.get("PYTHONHASHSEED") == "0"
