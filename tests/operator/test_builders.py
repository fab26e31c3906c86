from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import yaml

from agentserving.operator.builders import (
    ENGINES,
    Instance,
    SpecError,
    build_children,
    endpoint,
    workloads,
)
from agentserving.operator.builders.common import CONFIG_HASH_ANNOTATION
from agentserving.operator.settings import OperatorSettings

from .operator_testing import EXAMPLES, defaulted, make_instance, vllm_serve_of


def by_key(children):
    return {(c["kind"], c["metadata"]["name"]): c for c in children}


def worker(children, role):
    sts = by_key(children)[("StatefulSet", f"demo-{role}")]
    return sts["spec"]["template"]["spec"]["containers"][0]


def test_default_children_names_and_kinds(settings):
    children = build_children(make_instance(), settings)
    assert sorted(by_key(children)) == sorted([  # the reference engine reads no ConfigMap
        ("StatefulSet", "demo-prefill"), ("Service", "demo-prefill"),
        ("StatefulSet", "demo-decode"), ("Service", "demo-decode"),
        ("Deployment", "demo-kvindex"), ("Service", "demo-kvindex"),
        ("Deployment", "demo-proxy"), ("Service", "demo-proxy"),
    ])


def test_every_child_is_owned_and_labelled(settings):
    spec = {"model": {"name": "tiny"}, "kvindex": {"redis": {"inCluster": True}}}
    for child in build_children(make_instance(spec), settings):
        meta = child["metadata"]
        assert meta["namespace"] == "ns1"
        assert meta["ownerReferences"] == [{
            "apiVersion": "agentserving.io/v1alpha1", "kind": "AgentServing", "name": "demo",
            "uid": "uid-1234", "controller": True, "blockOwnerDeletion": True}]
        assert meta["labels"]["app.kubernetes.io/instance"] == "demo"
        assert meta["labels"]["app.kubernetes.io/managed-by"] == "agentserving-operator"


def test_the_token_reaches_agentservings_containers_only_and_a_users_variable_wins(settings):
    spec = {"model": {"name": "tiny"}, "kvindex": {"redis": {"inCluster": True}},
            "engine": {"env": [{"name": "AGENTSERVING_INTERNAL_TOKEN", "value": "mine"}]}}
    kids = by_key(build_children(make_instance(spec),
                                 dataclasses.replace(settings, token_key="k")))

    def token_vars(kind, name):  # type: ignore[no-untyped-def]
        pod = kids[(kind, name)]["spec"]["template"]["spec"]
        return [[e for e in c.get("env", []) if e["name"] == "AGENTSERVING_INTERNAL_TOKEN"]
                for c in pod["containers"]]

    from_secret = {"name": "AGENTSERVING_INTERNAL_TOKEN", "valueFrom": {"secretKeyRef": {
        "name": "demo-internal", "key": "token"}}}
    for kind, name in (("Deployment", "demo-kvindex"), ("Deployment", "demo-proxy")):
        assert token_vars(kind, name) == [[from_secret]], name
    # the user's own value comes after, so Kubernetes gives the container the user's
    assert token_vars("StatefulSet", "demo-decode") == [
        [from_secret, {"name": "AGENTSERVING_INTERNAL_TOKEN", "value": "mine"}]]
    assert token_vars("Deployment", "demo-redis") == [[]]
    assert ("Secret", "demo-internal") in kids
    # no token key: no Secret, no variable (nothing checks credentials)
    plain = build_children(make_instance(spec), settings)
    assert not any(c["kind"] == "Secret" for c in plain)
    assert "AGENTSERVING_INTERNAL_TOKEN" not in json.dumps(
        by_key(plain)[("Deployment", "demo-kvindex")])


def test_reference_worker_command_line_follows_the_contract(settings):
    spec = {"model": {"name": "/models/llama", "servedName": "llama", "maxContext": 4096},
            "kvCache": {"cpuGiB": 3, "diskGiB": 7, "hashScheme": "lmcache-builtin",
                        "chunkSize": 1024}}
    c = worker(build_children(make_instance(spec), settings), "decode")
    assert c["command"] == [
        "agentserving", "worker", "--role", "decode", "--host", "0.0.0.0",
        "--advertise-host", "$(POD_IP)", "--port", "8000", "--memory-port-start", "6999",
        "--model", "/models/llama", "--served-model-name", "llama", "--pod-name", "$(POD_NAME)",
        "--kvindex", "http://demo-kvindex.ns1.svc:8300", "--cpu-cache-gib", "3",
        "--disk-cache-dir", "/kvcache", "--disk-cache-gib", "7", "--chunk-size", "1024",
        "--hash-scheme", "lmcache-builtin",
        "--prefill-chunk-tokens", "1024",  # a prefill step is whole chunks
        "--max-model-len", "4096", "--scheduler-policy", "longcap-dynamic?lookahead=5"]
    env = {e["name"]: e for e in c["env"]}
    assert env["POD_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert env["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert c["image"] == "agentserving/worker:0.1.0"


def test_memory_api_ports_follow_tensor_parallel(settings):
    gpus = {"type": "nvidia", "count": 4}
    spec = {"model": {"name": "m"}, "engine": {"type": "vllm"},
            "prefill": {"tensorParallelSize": 4, "accelerator": gpus},
            "decode": {"accelerator": gpus}}
    children = build_children(make_instance(spec), settings)
    ports = {p["name"]: p["containerPort"] for p in worker(children, "prefill")["ports"]}
    assert ports == {"http": 8000, "mem-api": 6999, "mem-0": 7000, "mem-1": 7001, "mem-2": 7002,
                     "mem-3": 7003}
    decode_ports = [p["containerPort"] for p in worker(children, "decode")["ports"]]
    assert decode_ports == [8000, 6999, 7000]


def test_roles_and_pools_are_separate(settings):
    spec = {"model": {"name": "tiny"}, "prefill": {"replicas": 1}, "decode": {"replicas": 3}}
    children = by_key(build_children(make_instance(spec), settings))
    assert children[("StatefulSet", "demo-prefill")]["spec"]["replicas"] == 1
    assert children[("StatefulSet", "demo-decode")]["spec"]["replicas"] == 3
    assert "prefill" in children[("StatefulSet", "demo-prefill")]["spec"]["template"]["spec"][
        "containers"][0]["command"]
    for role in ("prefill", "decode"):
        sts = children[("StatefulSet", f"demo-{role}")]
        assert sts["spec"]["podManagementPolicy"] == "Parallel"
        assert sts["spec"]["serviceName"] == f"demo-{role}"
        assert sts["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == role
        svc = children[("Service", f"demo-{role}")]
        assert svc["spec"]["clusterIP"] == "None"


@pytest.mark.parametrize("acc, resource", [
    ({"type": "nvidia", "count": 2}, "nvidia.com/gpu"),
    ({"type": "ascend", "count": 1}, "huawei.com/ascend-1980"),
    ({"type": "ascend", "count": 8, "resourceName": "huawei.com/Ascend910"},
     "huawei.com/Ascend910"),
])
def test_accelerators_become_resource_limits(settings, acc, resource):
    engine = "vllm-ascend" if acc["type"] == "ascend" else "vllm"
    spec = {"model": {"name": "tiny"}, "engine": {"type": engine}, "decode": {"accelerator": acc},
            "prefill": {"accelerator": acc}, "kvCache": {"hashScheme": "lmcache-builtin"}}
    c = worker(build_children(make_instance(spec), settings), "decode")
    assert c["resources"]["limits"] == {resource: str(acc["count"])}
    assert c["resources"]["requests"] == {resource: str(acc["count"])}


def test_cpu_pool_asks_for_no_accelerator_and_keeps_own_resources(settings):
    spec = {"model": {"name": "tiny"},
            "prefill": {"resources": {"requests": {"cpu": "2", "memory": "4Gi"}}}}
    children = build_children(make_instance(spec), settings)
    assert worker(children, "prefill")["resources"] == {"requests": {"cpu": "2",
                                                                     "memory": "4Gi"}}
    assert "resources" not in worker(children, "decode")


def test_disk_tier_volume_empty_dir_or_claim(settings):
    children = by_key(build_children(make_instance(), settings))
    pod = children[("StatefulSet", "demo-decode")]["spec"]["template"]["spec"]
    vols = {v["name"]: v for v in pod["volumes"]}
    assert vols == {"kvcache": {"name": "kvcache", "emptyDir": {"sizeLimit": "50Gi"}}}
    mounts = {m["name"]: m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
    assert mounts == {"kvcache": "/kvcache"}  # the reference engine reads no config file
    vllm = {"model": {"name": "m"}, "engine": {"type": "vllm"}}
    pod = by_key(build_children(make_instance(vllm), settings))[
        ("StatefulSet", "demo-decode")]["spec"]["template"]["spec"]
    assert {v["name"]: v for v in pod["volumes"]}["config"]["configMap"]["name"] == "demo-config"
    assert {m["name"]: m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}[
        "config"] == "/etc/agentserving"

    spec = {"model": {"name": "tiny"}, "kvCache": {"diskGiB": 100,
                                                "diskVolume": {"storageClassName": "nvme"}}}
    sts = by_key(build_children(make_instance(spec), settings))[("StatefulSet", "demo-decode")]
    [claim] = sts["spec"]["volumeClaimTemplates"]
    assert claim["metadata"]["name"] == "kvcache"
    assert claim["spec"]["storageClassName"] == "nvme"
    assert claim["spec"]["resources"]["requests"]["storage"] == "100Gi"
    assert "kvcache" not in {v["name"] for v in sts["spec"]["template"]["spec"]["volumes"]}


def test_scheduling_fields_reach_the_pod(settings):
    tol = [{"key": "k", "operator": "Exists", "effect": "NoSchedule"}]
    spec = {"model": {"name": "tiny"}, "decode": {"nodeSelector": {"pool": "gpu"},
                                               "tolerations": tol, "schedulerName": "volcano"}}
    children = by_key(build_children(make_instance(spec), settings))
    pod = children[("StatefulSet", "demo-decode")]["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"pool": "gpu"}
    assert pod["tolerations"] == tol
    assert pod["schedulerName"] == "volcano"
    assert "nodeSelector" not in children[("StatefulSet", "demo-prefill")]["spec"]["template"][
        "spec"]


def test_proxy_and_kvindex_command_lines(settings):
    spec = {"model": {"name": "tiny"}, "proxy": {"routing": "session", "replicas": 3,
                                              "serviceType": "LoadBalancer"}}
    children = by_key(build_children(make_instance(spec), settings))
    proxy = children[("Deployment", "demo-proxy")]
    assert proxy["spec"]["replicas"] == 3
    assert proxy["spec"]["template"]["spec"]["containers"][0]["command"] == [
        "agentserving", "proxy", "--host", "0.0.0.0", "--port", "8080", "--kvindex",
        "http://demo-kvindex.ns1.svc:8300", "--routing", "session", "--chunk-size", "256",
        "--shared-sessions"]  # three replicas share each session's routing record
    assert children[("Service", "demo-proxy")]["spec"]["type"] == "LoadBalancer"
    spec["proxy"]["localPrefillTokens"] = 0  # always disaggregate
    spec["proxy"]["replicas"] = 1  # one proxy: its own memory is the whole record
    command = by_key(build_children(make_instance(spec), settings))[
        ("Deployment", "demo-proxy")]["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[-2:] == ["--local-prefill-tokens", "0"] and "--shared-sessions" not in command
    spec["proxy"]["admitPerPod"] = 1  # shortest prompt first at the door
    command = by_key(build_children(make_instance(spec), settings))[
        ("Deployment", "demo-proxy")]["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[-4:] == ["--local-prefill-tokens", "0", "--admit-per-pod", "1"]
    kvi = children[("Deployment", "demo-kvindex")]
    assert kvi["spec"]["template"]["spec"]["containers"][0]["command"] == [
        "agentserving", "kvindex", "--host", "0.0.0.0", "--port", "8300", "--store", "memory"]
    assert kvi["spec"]["strategy"] == {"type": "Recreate"}
    assert children[("Service", "demo-kvindex")]["spec"]["ports"][0]["port"] == 8300


def test_the_proxy_in_front_of_vllm_runs_what_the_main_job_measures(settings):
    """Unset, spec.proxy's admission and prefill backlog are agentserving's settings for the
    engine: the same flags `agentserving up` and `agentserving compare` give the proxy."""
    from agentserving.replay.configs import engine_proxy_args

    def proxy_command(spec):
        return by_key(build_children(make_instance(spec), settings))[
            ("Deployment", "demo-proxy")]["spec"]["template"]["spec"]["containers"][0]["command"]
    vllm = proxy_command({"model": {"name": "m"}, "engine": {"type": "vllm"}})
    assert vllm[-4:] == engine_proxy_args("vllm") == [
        "--admit-per-pod", "1", "--max-prefill-backlog", "1"]
    assert "--admit-per-pod" not in proxy_command({"model": {"name": "tiny"}})  # reference
    off = proxy_command({"model": {"name": "m"}, "engine": {"type": "vllm"},
                         "proxy": {"admitPerPod": 0, "maxPrefillBacklog": 2}})
    assert off[-4:] == ["--admit-per-pod", "0", "--max-prefill-backlog", "2"]


def test_kvindex_store_choices(settings):
    def store(kvindex):
        spec = {"model": {"name": "tiny"}, "kvindex": kvindex}
        children = by_key(build_children(make_instance(spec), settings))
        return children, children[("Deployment", "demo-kvindex")]["spec"]["template"]["spec"][
            "containers"][0]["command"][-1]

    children, s = store({"replicas": 2, "redis": {"url": "redis://r.example:6379/1"}})
    assert s == "redis://r.example:6379/1"
    assert ("Deployment", "demo-redis") not in children
    children, s = store({"replicas": 2, "redis": {"inCluster": True}})
    assert s == "redis://demo-redis.ns1.svc:6379/0"
    redis = children[("Deployment", "demo-redis")]
    assert redis["spec"]["template"]["spec"]["containers"][0]["image"] == "redis:7.4-alpine"
    assert children[("Service", "demo-redis")]["spec"]["ports"][0]["port"] == 6379
    # Redis behind Sentinel, each write acknowledged once a replica holds it
    sentinel = "redis+sentinel://s0:26379,s1:26379/kv/0"
    children, _ = store({"replicas": 2, "redis": {"url": sentinel, "minAcks": 1}})
    command = children[("Deployment", "demo-kvindex")]["spec"]["template"]["spec"][
        "containers"][0]["command"]
    assert command[-4:] == ["--store", sentinel, "--redis-min-acks", "1"]


@pytest.mark.parametrize("spec, field", [
    ({"kvindex": {"replicas": 2}}, "spec.kvindex.replicas"),
    ({"kvindex": {"redis": {"url": "redis://x:1/0", "inCluster": True}}}, "spec.kvindex.redis"),
    ({"engine": {"type": "vllm-ascend"}}, "spec.prefill.accelerator.type"),
    ({"engine": {"type": "vllm"}, "decode": {"accelerator": {"type": "ascend"}}},
     "spec.decode.accelerator.type"),
    ({"engine": {"type": "vllm"}, "prefill": {"schedulerPolicy": "shadow"}},
     "spec.prefill.schedulerPolicy"),
    ({"engine": {"type": "vllm"}, "kvCache": {"prefetch": {"policy": "shadow-scheduler"}}},
     "spec.kvCache.prefetch.policy"),
    ({"engine": {"type": "vllm-ascend"}, "prefill": {"schedulerPolicy": "longcap-dynamic",
                                                      "accelerator": {"type": "ascend"}}},
     "spec.prefill.schedulerPolicy"),
])
def test_unservable_specs_name_the_field(settings, spec, field):
    with pytest.raises(SpecError) as e:
        build_children(make_instance({"model": {"name": "tiny"}, **spec}), settings)
    assert e.value.field_path == field
    assert str(e.value).startswith(field)


def test_a_vllm_prefill_pool_runs_its_policy_inside_vllms_scheduler(settings):
    spec = {"model": {"name": "tiny"}, "engine": {"type": "vllm"},
            "prefill": {"schedulerPolicy": "longcap-dynamic"}}
    children = by_key(build_children(make_instance(spec), settings))
    serve = {role: vllm_serve_of(children[("StatefulSet", f"demo-{role}")]["spec"]["template"]
                                 ["spec"]["containers"][0]) for role in ("prefill", "decode")}
    prefill, decode = serve["prefill"], serve["decode"]
    at = prefill["argv"].index("--scheduler-cls")
    assert prefill["argv"][at + 1] == "agentserving.engine.vllm.schedulers.PolicyScheduler"
    assert prefill["env"]["AGENTSERVING_PREFILL_POLICY"] == "longcap-dynamic"
    # the decode pool keeps vLLM's own scheduling, its prefix cache a managed tier
    at = decode["argv"].index("--scheduler-cls")
    assert decode["argv"][at + 1] == "agentserving.engine.vllm.schedulers.DeviceKvScheduler"
    assert "AGENTSERVING_PREFILL_POLICY" not in decode["env"]


def test_a_vllm_prefill_pool_runs_the_shadow_scheduler_when_prefetch_asks(settings):
    spec = {"model": {"name": "tiny"}, "engine": {"type": "vllm"},
            "prefill": {"schedulerPolicy": "longcap-dynamic"},
            "kvCache": {"prefetch": {"policy": "shadow-scheduler", "lookahead": 3}}}
    children = by_key(build_children(make_instance(spec), settings))
    serve = {role: vllm_serve_of(children[("StatefulSet", f"demo-{role}")]["spec"]["template"]
                                 ["spec"]["containers"][0]) for role in ("prefill", "decode")}
    assert serve["prefill"]["env"]["AGENTSERVING_PREFILL_POLICY"] == "longcap-dynamic?lookahead=3"
    assert "AGENTSERVING_PREFILL_POLICY" not in serve["decode"]["env"]  # fcfs: no shadow


def test_changing_one_pools_replicas_changes_only_that_pool(settings):
    base = {"model": {"name": "tiny"}, "prefill": {"replicas": 1}, "decode": {"replicas": 2}}
    before = by_key(build_children(make_instance(base), settings))
    scaled = copy.deepcopy(base)
    scaled["prefill"]["replicas"] = 4
    after = by_key(build_children(make_instance(scaled), settings))
    changed = {k for k in before if before[k] != after[k]}
    assert changed == {("StatefulSet", "demo-prefill")}
    assert after[("StatefulSet", "demo-prefill")]["spec"]["replicas"] == 4


def test_cache_settings_change_config_and_roll_both_pools(settings):
    base = {"model": {"name": "m"}, "engine": {"type": "vllm"}}
    before = by_key(build_children(make_instance(base), settings))
    after = by_key(build_children(make_instance({**base, "kvCache": {"cpuGiB": 32}}), settings))
    changed = {k for k in before if before[k] != after[k]}
    assert changed == {("ConfigMap", "demo-config"), ("StatefulSet", "demo-prefill"),
                       ("StatefulSet", "demo-decode")}
    def config_hash(children, role):
        template = children[("StatefulSet", f"demo-{role}")]["spec"]["template"]
        return template["metadata"]["annotations"][CONFIG_HASH_ANNOTATION]

    for role in ("prefill", "decode"):
        assert config_hash(before, role) != config_hash(after, role)
    lmcache = yaml.safe_load(after[("ConfigMap", "demo-config")]["data"]["lmcache.yaml"])
    assert lmcache["max_local_cpu_size"] == 32.0
    assert lmcache["chunk_size"] == 256
    assert lmcache["local_disk"] == "file:///kvcache/"


def test_proxy_change_touches_only_the_proxy(settings):
    base = {"model": {"name": "tiny"}}
    before = by_key(build_children(make_instance(base), settings))
    after = by_key(build_children(make_instance({**base, "proxy": {"routing": "round-robin"}}),
                                  settings))
    assert {k for k in before if before[k] != after[k]} == {("Deployment", "demo-proxy")}


def test_vllm_engine_renders_the_worker_command_that_becomes_vllm_serve(settings):
    spec = {"model": {"name": "Qwen/Qwen2.5-7B", "servedName": "qwen", "maxContext": 32768},
            "engine": {"type": "vllm", "args": ["--enforce-eager"]},
            "kvCache": {"hashScheme": "lmcache-builtin"},
            "prefill": {"accelerator": {"type": "nvidia", "count": 2}, "tensorParallelSize": 2}}
    c = worker(build_children(make_instance(spec), settings), "prefill")
    assert c["command"][:2] == ["agentserving", "worker"]
    assert c["command"][c["command"].index("--engine") + 1] == "vllm"
    served = vllm_serve_of(c)  # parsed by the real worker CLI
    cmd = served["argv"]
    assert cmd[2:5] == ["agentserving.engine.vllm.launch", "serve", "Qwen/Qwen2.5-7B"]
    assert cmd[cmd.index("--tensor-parallel-size") + 1] == "2"
    assert cmd[cmd.index("--served-model-name") + 1] == "qwen"
    assert cmd[cmd.index("--max-model-len") + 1] == "32768"
    assert cmd[cmd.index("--host") + 1] == "0.0.0.0"
    ktc = json.loads(cmd[cmd.index("--kv-transfer-config") + 1])
    assert ktc["kv_role"] == "kv_both"  # decode pods keep what they pull and compute
    extra = ktc["kv_connector_extra_config"]
    assert extra["pod_role"] == "prefill" and extra["public_host"] == "$(POD_IP)"
    assert cmd[-1] == "--enforce-eager"
    assert served["env"]["PYTHONHASHSEED"] == "0"
    assert c["image"] == OperatorSettings().vllm_image
    assert [p["containerPort"] for p in c["ports"]] == [8000, 6999, 7000, 7001]
    decode = vllm_serve_of(worker(build_children(make_instance(spec), settings), "decode"))
    dktc = json.loads(decode["argv"][decode["argv"].index("--kv-transfer-config") + 1])
    assert dktc["kv_connector_extra_config"]["pod_role"] == "decode"


def test_engine_image_and_env_overrides(settings):
    spec = {"model": {"name": "tiny"}, "engine": {"image": "me/worker:dev",
                                               "env": [{"name": "X", "value": "1"}]}}
    c = worker(build_children(make_instance(spec), settings), "prefill")
    assert c["image"] == "me/worker:dev"
    assert {"name": "X", "value": "1"} in c["env"]


def test_engine_builders_are_swappable(settings, monkeypatch):
    def custom(ctx):
        return {"name": "worker", "image": ctx.image, "command": ["custom", ctx.role],
                "ports": [], "env": []}

    monkeypatch.setitem(ENGINES, "reference", custom)
    c = worker(build_children(make_instance(), settings), "decode")
    assert c["command"] == ["custom", "decode"]
    assert c["volumeMounts"][0]["mountPath"] == "/kvcache"


def test_settings_images(settings):
    s = OperatorSettings(image_registry="reg.example/as", image_tag="9.9")
    children = by_key(build_children(make_instance(), s))
    images = {k: v["spec"]["template"]["spec"]["containers"][0]["image"]
              for k, v in children.items() if k[0] in ("StatefulSet", "Deployment")}
    assert images == {("StatefulSet", "demo-prefill"): "reg.example/as/worker:9.9",
                      ("StatefulSet", "demo-decode"): "reg.example/as/worker:9.9",
                      ("Deployment", "demo-kvindex"): "reg.example/as/kvindex:9.9",
                      ("Deployment", "demo-proxy"): "reg.example/as/proxy:9.9"}


def test_workloads_and_endpoint():
    inst = make_instance({"model": {"name": "tiny"}, "kvindex": {"redis": {"inCluster": True}}})
    assert workloads(inst) == {
        "prefill": ("StatefulSet", "demo-prefill"), "decode": ("StatefulSet", "demo-decode"),
        "proxy": ("Deployment", "demo-proxy"), "kvindex": ("Deployment", "demo-kvindex"),
        "redis": ("Deployment", "demo-redis")}
    assert endpoint(inst) == "http://demo-proxy.ns1.svc:8080/v1"


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_examples_build(settings, path):
    doc = yaml.safe_load(path.read_text())
    inst = Instance(doc["metadata"]["name"], "default", "u", defaulted(doc["spec"]))
    children = build_children(inst, settings)
    kinds = [c["kind"] for c in children]
    assert kinds.count("StatefulSet") == 2
    assert len(children) >= 8


def test_examples_cover_every_engine():
    engines = {yaml.safe_load(p.read_text())["spec"]["engine"]["type"] for p in EXAMPLES}
    assert engines == set(ENGINES)


@pytest.mark.parametrize("change, expected", [
    ({"decode": {"replicas": 5}}, {("StatefulSet", "demo-decode")}),
    ({"engine": {"image": "me/worker:2"}},
     {("StatefulSet", "demo-prefill"), ("StatefulSet", "demo-decode")}),
    ({"prefill": {"schedulerPolicy": "fcfs-chunk"}}, {("StatefulSet", "demo-prefill")}),
    ({"kvCache": {"prefetch": {"policy": "shadow-scheduler", "lookahead": 2}}},
     {("StatefulSet", "demo-prefill"), ("StatefulSet", "demo-decode")}),
    ({"kvindex": {"image": "me/kvindex:2"}}, {("Deployment", "demo-kvindex")}),
    ({"proxy": {"serviceType": "NodePort"}}, {("Service", "demo-proxy")}),
])
def test_each_field_rolls_only_its_children(settings, change, expected):
    base = {"model": {"name": "tiny"}}
    before = by_key(build_children(make_instance(base), settings))
    after = by_key(build_children(make_instance({**base, **change}), settings))
    assert set(before) == set(after)
    assert {k for k in before if before[k] != after[k]} == expected
