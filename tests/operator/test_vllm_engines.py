"""The vLLM and vLLM-Ascend pods against seed 000: `vllm serve` with the LMCache connector in
--kv-transfer-config, kv_role per pool, the LMCache config file (chunk size, CPU and disk tiers,
internal API server on 6999), PYTHONHASHSEED, accelerators and the Ascend host mounts."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest
import yaml

from agentserving.engine.model.folders import MODEL_CACHE
from agentserving.engine.vllm.serve_command import FORCING_LOGITS
from agentserving.operator.builders import build_children
from agentserving.operator.builders.engines import WorkerContext, engine_volumes
from agentserving.operator.builders.kvserver import OVERHEAD_MIB

from .operator_testing import EXAMPLES, defaulted, make_instance, vllm_serve_of
from .seed000 import flags, seed_command, seed_spec

CONNECTOR_SOURCE = Path(__file__).parents[2] / "engine" / "vllm" / "connector.py"

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
    "kvCache": {"chunkSize": 512, "cpuGiB": 8, "diskGiB": 0, "hashScheme": "lmcache-builtin"},
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
    served = vllm_serve_of(c)
    ktc = json.loads(flag(served["argv"], "--kv-transfer-config"))
    # AgentServing's connector (engine/vllm/connector.py), a subclass of LMCache's
    assert ktc["kv_connector"] == "AgentServingConnectorV1"
    assert ktc["kv_connector_module_path"] == "agentserving.engine.vllm.connector"
    assert importlib.util.find_spec(ktc["kv_connector_module_path"]) is not None
    assert re.search(r"^class AgentServingConnectorV1\(LMCacheConnectorV1Dynamic\)",
                     CONNECTOR_SOURCE.read_text(), re.M)
    assert ktc["kv_role"] == "kv_both"  # a decode pod keeps what it pulls and computes
    extra = ktc["kv_connector_extra_config"]
    # what the connector's settings parser reads, and accepts (as the pod expands the refs)
    from agentserving.engine.vllm.settings import parse_settings

    pod_env = {"POD_NAME": "demo-decode-0", "POD_IP": "10.0.0.9"}
    parsed = parse_settings({k: v.replace("$(POD_NAME)", pod_env["POD_NAME"]).replace(
        "$(POD_IP)", pod_env["POD_IP"]) if isinstance(v, str) else v
        for k, v in extra.items()}, pod_env)
    assert parsed.kvindex_url == "http://demo-kvindex.ns1.svc:8300"
    assert (parsed.memory_port_start, parsed.api_port, parsed.hash_scheme) == (6999, 8000,
                                                                               "lmcache-builtin")
    assert parsed.public_host == "10.0.0.9" and parsed.pod_name == "demo-decode-0"
    assert parsed.pod_role.value == "decode"
    e = {x["name"]: x for x in c["env"]}
    assert e["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert "LMCACHE_LMCACHE_INSTANCE_ID" not in e
    assert [x["name"] for x in kids[("StatefulSet", "demo-decode")]["spec"]["template"]["spec"][
        "containers"]] == ["worker", "kvserver"]  # the connector registers the pod itself;
    # the second container is the pod's own KV server (p2p, vLLM's default backend)
    assert served["env"]["PYTHONHASHSEED"] == "0"  # LMCache's builtin chain starts from it
    assert "LMCACHE_LOCAL_DISK" not in served["env"]  # diskGiB 0: no disk tier
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"


@pytest.mark.parametrize("engine", ["vllm", "vllm-ascend"])
def test_blake3_is_refused_for_vllm_engines_naming_the_field(settings, engine):
    from agentserving.operator.builders.common import SpecError

    base = ASCEND if engine == "vllm-ascend" else NVIDIA
    spec = {**base, "kvCache": {**base["kvCache"], "hashScheme": "blake3"}}
    with pytest.raises(SpecError) as err:
        children(spec, settings)
    assert err.value.field_path == "spec.kvCache.hashScheme"


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
    # LMCache-Ascend's switches for its memory API and chunk_hashes return
    assert data["enable_chunk_hashes_return"] is True and data["enable_async_loading"] is True
    assert data["lookup_hashes_cache_size"] > 0
    # its controller is the kvindex; one controller-facing port per TP rank
    assert data["enable_controller"] is True
    assert data["controller_pull_url"] == "demo-kvindex.ns1.svc:8301"
    assert data["controller_reply_url"] == "demo-kvindex.ns1.svc:8302"
    assert data["lmcache_worker_ports"] == list(range(7200, 7216))
    # LMCache's own parser accepts every key the operator writes (LMCache-Ascend's two extra
    # keys are unknown to stock LMCache: it warns and ignores them)
    cfg = LMCacheEngineConfig.from_dict(data)
    assert cfg.chunk_size == 256 and cfg.internal_api_server_port_start == 6999
    assert cfg.enable_controller and cfg.lmcache_worker_ports == list(range(7200, 7216))
    nv = yaml.safe_load(children(NVIDIA, settings)[("ConfigMap", "demo-config")]["data"][
        "lmcache.yaml"])
    assert "local_disk" not in nv and nv["chunk_size"] == 512
    # vLLM: our connector serves the memory API on 6999+; LMCache's server and controller stay off
    assert nv["internal_api_server_enabled"] is False and "enable_controller" not in nv
    assert LMCacheEngineConfig.from_dict(nv).internal_api_server_enabled is False
    # the reference worker serves its own memory API and configures LMCache from its flags
    assert ("ConfigMap", "demo-config") not in children({"model": {"name": "tiny"}}, settings)


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
        cmd = vllm_serve_of(c)["argv"] if engine == "vllm" else c["command"]
        assert cmd[cmd.index("serve") - 1:][:1] in (["vllm"], ["agentserving.engine.vllm.launch"])
        kv_role = json.loads(flag(cmd, "--kv-transfer-config"))["kv_role"]
        assert kv_role == ("kv_both" if engine == "vllm" else "kv_producer")
    assert seen == {"vllm", "vllm-ascend"}


def test_the_smollm2_example_serves_its_converted_folder_with_teacher_forcing(settings):
    path = next(p for p in EXAMPLES if p.name == "agentserving-vllm-cpu-smollm2.yaml")
    spec = yaml.safe_load(path.read_text())["spec"]
    for role in ("prefill", "decode"):
        argv = vllm_serve_of(worker(children(spec, settings), role))["argv"]
        assert argv[argv.index("serve") + 1] == str(MODEL_CACHE / "smollm2")
        assert flag(argv, "--dtype") == "float32"
        assert flag(argv, "--logits-processors") == FORCING_LOGITS


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


# ---------------------------------------------------------------- seed 000, line by line


@pytest.mark.parametrize("engine", ["vllm-ascend", "vllm"])
@pytest.mark.parametrize("role,kv_role", [("prefill", "kv_producer"), ("decode", "kv_consumer")])
def test_rendered_pod_runs_seed_000s_command(settings, engine, role, kv_role):
    env, argv, urls = seed_command()
    kids = children(seed_spec(engine), settings)
    c = worker(kids, role)
    if engine == "vllm":  # agentserving worker --engine vllm: the vllm serve it runs
        served = vllm_serve_of(c)
        cmd, pod_env = served["argv"][2:], {**served["env"], **{
            x["name"]: x.get("value") for x in c["env"]}}
        assert cmd[:2] == ["agentserving.engine.vllm.launch", "serve"]
    else:
        cmd, pod_env = c["command"], {x["name"]: x.get("value") for x in c["env"]}
        assert cmd[:2] == argv[:2]  # vllm serve
    assert cmd[2] == argv[2]  # <model>
    want, got = flags(argv[3:]), flags(cmd[3:])
    for k, v in want.items():
        if k == "--port":  # the pod serves on the worker port the proxy and probes use
            assert got[k] == "8000"
        elif k == "--no-enable-prefix-caching" and engine == "vllm":
            # vLLM's prefix cache is the device tier under LMCache's CPU and disk tiers
            assert k not in got
        elif k == "--kv-transfer-config":
            seed_ktc, ktc = json.loads(v), json.loads(got[k])
            if engine == "vllm-ascend":  # LMCache-Ascend's connector, exactly the seed's
                assert {k2: ktc[k2] for k2 in ("kv_connector", "kv_connector_module_path")} == \
                    {k2: seed_ktc[k2] for k2 in ("kv_connector", "kv_connector_module_path")}
            else:
                assert ktc["kv_connector_module_path"] == "agentserving.engine.vllm.connector"
            # the seed runs one pod (kv_both); an LMCache-Ascend P/D pool is producer or
            # consumer; AgentServing's vLLM pods are kv_both (decode pods keep their KV)
            want_role = kv_role if engine == "vllm-ascend" else "kv_both"
            assert seed_ktc["kv_role"] == "kv_both" and ktc["kv_role"] == want_role
        else:
            assert got.get(k, "absent") == v, k
    e = pod_env
    for k, v in env.items():
        if k != "LMCACHE_CONFIG_FILE":
            assert e[k] == v, k
    assert e["LMCACHE_CONFIG_FILE"] == "/etc/agentserving/lmcache.yaml"
    # the memory API the seed calls (POST :6999/memory/{evict,prefetch}) is the pod's mem-api
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert {u.split("/")[2].split(":")[1] for u in urls} == {str(ports["mem-api"])}
    assert {"/" + u.split("/", 3)[3] for u in urls} == {"/memory/evict", "/memory/prefetch"}
    assert [ports[f"mem-{k}"] for k in range(16)] == list(range(7000, 7016))
    lm = yaml.safe_load(kids[("ConfigMap", "demo-config")]["data"]["lmcache.yaml"])
    assert lm["chunk_size"] == 256 and lm["max_local_cpu_size"] == 100.0
    assert lm["max_local_disk_size"] == 500.0
    if engine == "vllm-ascend":
        assert lm["internal_api_server_port_start"] == ports["mem-api"]
    else:
        extra = json.loads(got["--kv-transfer-config"])["kv_connector_extra_config"]
        assert extra["memory_port_start"] == ports["mem-api"]


def test_ascend_pods_get_the_registrar_and_the_kvindex_the_controller(settings):
    kids = children(ASCEND, settings)
    pod = kids[("StatefulSet", "demo-prefill")]["spec"]["template"]["spec"]
    names = [c["name"] for c in pod["containers"]]
    assert names == ["worker", "kvindex-registrar"]
    reg = pod["containers"][1]
    cmd = reg["command"]
    assert cmd[:3] == ["python", "-m", "agentserving.engine.vllm.registrar"]
    assert flag(cmd, "--memory-api-url") == "http://$(POD_IP):6999"
    assert flag(cmd, "--role") == "prefill" and flag(cmd, "--model") == "glm4.7"
    assert flag(cmd, "--hash-scheme") == "lmcache-builtin"
    assert reg["image"] == settings.image("worker")  # AgentServing's image, not vLLM-Ascend's
    from agentserving.engine.vllm.registrar_cli import parse_args

    args = parse_args([a.replace("$(POD_IP)", "10.0.0.5").replace("$(POD_NAME)", "demo-p-0")
                       for a in cmd[3:]])
    assert args.registration().memory_api_url == "http://10.0.0.5:6999"
    # the worker names itself to LMCache's controller by its pod name
    e = {x["name"]: x.get("value") for x in pod["containers"][0]["env"]}
    assert e["LMCACHE_LMCACHE_INSTANCE_ID"] == "$(POD_NAME)"
    names_env = [x["name"] for x in pod["containers"][0]["env"]]
    assert names_env.index("POD_NAME") < names_env.index("LMCACHE_LMCACHE_INSTANCE_ID")
    kvi = kids[("Deployment", "demo-kvindex")]["spec"]["template"]["spec"]["containers"][0]
    assert flag(kvi["command"], "--lmcache-controller") == "tcp://0.0.0.0:8301"
    svc_ports = {p["name"]: p["port"] for p in kids[("Service", "demo-kvindex")]["spec"]["ports"]}
    assert svc_ports == {"http": 8300, "lmcache-pull": 8301, "lmcache-reply": 8302}
    # the kvindex CLI accepts the flag the operator renders
    from click.testing import CliRunner

    from agentserving.kvindex.cli import command

    help_text = CliRunner().invoke(command, ["--help"]).output
    assert "--lmcache-controller" in help_text
    nv = children(NVIDIA, settings)
    kvi_nv = nv[("Deployment", "demo-kvindex")]["spec"]["template"]["spec"]["containers"][0]
    assert "--lmcache-controller" not in kvi_nv["command"]


@pytest.mark.parametrize(("engine", "scheme"), [("reference", "blake3"),
                                                 ("vllm", "lmcache-builtin"),
                                                 ("vllm-ascend", "lmcache-ascend")])
def test_unset_hash_scheme_follows_the_engine(settings, engine, scheme):
    base = {"reference": {"model": {"name": "tiny"}}, "vllm": NVIDIA, "vllm-ascend": ASCEND}[engine]
    kv = {k: v for k, v in base.get("kvCache", {}).items() if k != "hashScheme"}
    spec = {**base, "engine": {"type": engine}, "kvCache": kv}
    kids = children(spec, settings)  # servable without naming a scheme
    for role in ("prefill", "decode"):  # what the pod registers with the kvindex
        containers = kids[("StatefulSet", f"demo-{role}")]["spec"]["template"]["spec"][
            "containers"]
        assert [flag(c["command"], "--hash-scheme") for c in containers
                if "--hash-scheme" in c["command"]] == [scheme]


def pod_containers(kids, role):
    return kids[("StatefulSet", f"demo-{role}")]["spec"]["template"]["spec"]["containers"]


def with_kv(**kv):
    return {**NVIDIA, "kvCache": {**NVIDIA["kvCache"], **kv}}


KVSERVER_ARGV = ["agentserving", "kvserver", "--host", "0.0.0.0", "--port", "65432",
                 "--api-port", "65433", "--max-gib"]


def test_p2p_backend_runs_a_kv_server_in_every_vllm_pod(settings):
    spec = with_kv(transferBackend="p2p", transferGiB=3)
    kids = children({**spec, "engine": {"type": "vllm", "imagePullPolicy": "Always"}}, settings)
    for role in ("prefill", "decode"):
        worker_c, server = pod_containers(kids, role)
        assert server["name"] == "kvserver"
        assert server["command"] == [*KVSERVER_ARGV, "3"]
        assert server["image"] == worker_c["image"] == settings.vllm_image
        assert server["imagePullPolicy"] == worker_c["imagePullPolicy"] == "Always"
        assert {p["name"]: p["containerPort"] for p in server["ports"]} == {
            "lm": 65432, "kv-api": 65433}
        assert server["readinessProbe"]["httpGet"] == {"path": "/healthz", "port": "kv-api"}
        # small CPU, and room for its 3 GiB bound (a lower limit would kill it, not evict)
        assert server["resources"]["requests"]["cpu"] == "100m"
        assert server["resources"]["limits"]["memory"] == f"{3 * 1024 + OVERHEAD_MIB}Mi"
        assert "nvidia.com/gpu" not in server["resources"]["limits"]
        cmd = worker_c["command"]  # the engine hands KV to its own server over loopback
        assert flag(cmd, "--kv-transfer-url") == "lm://127.0.0.1:65432"
        assert flag(cmd, "--kv-server-api") == "http://127.0.0.1:65433"
        assert "--kv-transfer-p2p" in cmd
        assert flag(cmd, "--advertise-host") == "$(POD_IP)"  # where peers reach its server
    # no central server
    assert not [k for k in kids if k[1] == "demo-kvserver"]


def test_p2p_is_the_default_of_vllm(settings):
    kv = {k: v for k, v in NVIDIA["kvCache"].items() if k != "transferBackend"}
    kids = children({**NVIDIA, "kvCache": kv}, settings)
    assert [c["name"] for c in pod_containers(kids, "decode")] == ["worker", "kvserver"]
    # the CRD's default bound
    assert pod_containers(kids, "decode")[1]["command"] == [*KVSERVER_ARGV, "2"]
    assert ("Deployment", "demo-kvserver") not in kids
    # the reference engine runs no KV server at all
    ref = children({"model": {"name": "tiny"}}, settings)
    assert [c["name"] for c in pod_containers(ref, "prefill")] == ["worker"]
    assert ("Deployment", "demo-kvserver") not in ref


def test_lmcache_server_backend_runs_the_bounded_kv_server_and_points_vllm_pods_at_it(settings):
    kids = children(with_kv(transferBackend="lmcache-server", transferGiB=0.5), settings)
    server = kids[("Deployment", "demo-kvserver")]["spec"]["template"]["spec"]["containers"][0]
    assert server["command"] == [*KVSERVER_ARGV, "0.5"]
    assert server["image"] == settings.vllm_image  # agentserving comes with the vLLM image
    assert server["resources"]["limits"]["memory"] == f"{512 + OVERHEAD_MIB}Mi"
    svc = kids[("Service", "demo-kvserver")]["spec"]
    assert [(p["name"], p["port"]) for p in svc["ports"]] == [("lm", 65432), ("kv-api", 65433)]
    for role in ("prefill", "decode"):
        assert [c["name"] for c in pod_containers(kids, role)] == ["worker"]
        cmd = worker(kids, role)["command"]
        assert flag(cmd, "--kv-transfer-url") == "lm://demo-kvserver.ns1.svc:65432"
        assert flag(cmd, "--kv-server-api") == "http://demo-kvserver.ns1.svc:65433"
        assert "--kv-transfer-p2p" not in cmd
        served = vllm_serve_of(worker(kids, role))
        assert served["env"]["LMCACHE_REMOTE_URL"] == "lm://demo-kvserver.ns1.svc:65432"


@pytest.mark.parametrize("backend", ["p2p", "lmcache-server"])
def test_every_kv_server_reads_the_resources_internal_token(backend):
    """Its API evicts (and with p2p, one pod's server pulls from another's): it checks the
    token the workers send."""
    from agentserving.core.internal_auth import TOKEN_ENV
    from agentserving.operator.settings import OperatorSettings

    kids = children(with_kv(transferBackend=backend), OperatorSettings(token_key="k"))
    servers = [c for (kind, _), k in kids.items() if kind in ("Deployment", "StatefulSet")
               for c in k["spec"]["template"]["spec"]["containers"] if c["name"] == "kvserver"]
    assert len(servers) == {"p2p": 2, "lmcache-server": 1}[backend]
    for c in servers:
        assert c["env"][0]["name"] == TOKEN_ENV
        assert c["env"][0]["valueFrom"]["secretKeyRef"]["name"] == "demo-internal"


@pytest.mark.parametrize("gib", [0, -1, "2", None])
def test_a_transfer_bound_that_is_not_a_positive_number_is_refused(settings, gib):
    from agentserving.operator.builders.common import SpecError

    for backend in ("p2p", "lmcache-server"):
        with pytest.raises(SpecError) as err:
            children(with_kv(transferBackend=backend, transferGiB=gib), settings)
        assert err.value.field_path == "spec.kvCache.transferGiB"


def test_the_crd_bounds_the_transfer_store():
    import jsonschema

    from .operator_testing import spec_schema

    kv = spec_schema()["properties"]["kvCache"]
    assert kv["properties"]["transferGiB"]["default"] == 2
    check = jsonschema.Draft4Validator(kv)  # apiextensions: a boolean exclusiveMinimum
    assert check.is_valid({"transferGiB": 0.5})
    assert not check.is_valid({"transferGiB": 0})
    assert not check.is_valid({"transferGiB": -1})
    assert not check.is_valid({"transferBackend": "nfs"})


@pytest.mark.parametrize(("engine", "backend"), [("reference", "tcp"),
                                                 ("vllm", "p2p"),
                                                 ("vllm-ascend", "tcp")])
def test_unset_transfer_backend_is_the_one_the_engine_moves_kv_with(engine, backend):
    from agentserving.operator.builders.common import with_engine_defaults
    from agentserving.operator.builders.engines import check_transfer_backend

    spec = with_engine_defaults(defaulted({"model": {"name": "m"}, "engine": {"type": engine}}))
    assert spec["kvCache"]["transferBackend"] == backend
    check_transfer_backend(engine, backend)  # and it passes the check


@pytest.mark.parametrize(("engine", "backend"), [("vllm", "tcp"),
                                                 ("reference", "lmcache-server"),
                                                 ("reference", "p2p"),
                                                 ("vllm-ascend", "lmcache-server"),
                                                 ("vllm-ascend", "p2p")])
def test_a_transfer_backend_that_moves_no_kv_is_refused_naming_both_fields(engine, backend):
    from agentserving.operator.builders.common import SpecError
    from agentserving.operator.builders.engines import check_transfer_backend

    with pytest.raises(SpecError) as err:
        check_transfer_backend(engine, backend)
    assert err.value.field_path == "spec.kvCache.transferBackend"
    assert f"spec.engine.type {engine} " in str(err.value)
    assert f"spec.kvCache.transferBackend {backend} " in str(err.value)
    assert "moves no KV" in str(err.value)


def test_vllm_on_tcp_is_refused_before_anything_is_built(settings):
    from agentserving.operator.builders.common import SpecError

    with pytest.raises(SpecError) as err:
        children({**NVIDIA, "kvCache": {**NVIDIA["kvCache"], "transferBackend": "tcp"}},
                 settings)
    assert err.value.field_path == "spec.kvCache.transferBackend"


@pytest.mark.parametrize("backend", ["lmcache-server", "p2p"])
@pytest.mark.parametrize("base", ["reference", "vllm-ascend"])
def test_kv_server_backends_are_for_vllm_only(settings, backend, base):
    from agentserving.operator.builders.common import SpecError

    spec = {"reference": {"model": {"name": "tiny"}}, "vllm-ascend": ASCEND}[base]
    with pytest.raises(SpecError) as err:
        children({**spec, "kvCache": {**spec.get("kvCache", {}), "transferBackend": backend}},
                  settings)
    assert err.value.field_path == "spec.kvCache.transferBackend"
    assert f"spec.engine.type {base} with spec.kvCache.transferBackend {backend} " in str(
        err.value)
