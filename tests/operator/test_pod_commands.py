"""Every example rendered into its pods, and each pod checked against what its process itself
parses and loads: the real click commands and settings (every flag, every AGENTSERVING_*
variable, every policy), the worker's own model loader, the addresses it binds and registers,
and who reads each mounted file. Nothing starts; nothing is downloaded."""

from __future__ import annotations

import json
from pathlib import PurePosixPath

import pytest
import yaml

from agentserving.operator.builders import Instance, build_children
from agentserving.operator.settings import OperatorSettings

from .operator_testing import (
    EXAMPLES,
    POD_FIELDS,
    container_env,
    containers_of,
    defaulted,
    parse_agentserving,
    pod_argv,
)

POD_IP = POD_FIELDS["status.podIP"]
IDS = [p.name for p in EXAMPLES]
# Environment variables naming a file, and the engines whose process reads the file they name
# (LMCache configures itself from LMCACHE_CONFIG_FILE inside vLLM; the reference worker builds
# its LMCache config from its flags).
FILE_READERS = {"LMCACHE_CONFIG_FILE": {"vllm", "vllm-ascend"}}


def render(path):
    doc = yaml.safe_load(path.read_text())
    inst = Instance(doc["metadata"]["name"], "ns1", "uid-1", defaulted(doc["spec"]))
    return inst, build_children(inst, OperatorSettings())


def pools(inst, children):
    return [c for c in children if c["kind"] == "StatefulSet"
            and c["metadata"]["name"] in (inst.child_name("prefill"), inst.child_name("decode"))]


def flag(argv, name):
    return argv[argv.index(name) + 1]


def registrar_args(container):
    from agentserving.engine.vllm.registrar_cli import parse_args

    argv = pod_argv(container)
    assert argv[:3] == ["python", "-m", "agentserving.engine.vllm.registrar"], argv
    return parse_args(argv[3:])


@pytest.mark.parametrize("path", EXAMPLES, ids=IDS)
def test_every_agentserving_container_parses_with_the_real_cli(path):
    inst, children = render(path)
    parsed = {}
    for name, container in containers_of(children):
        argv = pod_argv(container)
        if argv[0] == "agentserving":
            sub, settings = parse_agentserving(container)  # raises on anything it would refuse
            parsed[name, container["name"]] = (sub, settings)
            if sub == "worker" and settings.engine == "vllm":
                from agentserving.engine.vllm.serve_command import build

                build(settings)  # the `vllm serve` command line it would exec
        elif container["name"] == "kvindex-registrar":
            registrar_args(container)
    subs = sorted(sub for sub, _ in parsed.values())
    workers = 0 if inst.spec["engine"]["type"] == "vllm-ascend" else 2
    kvservers = {"p2p": workers, "lmcache-server": 1}.get(
        inst.spec["kvCache"]["transferBackend"], 0)
    assert subs == sorted(["kvindex", "proxy"] + ["worker"] * workers + ["kvserver"] * kvservers)
    chunk = inst.spec["kvCache"]["chunkSize"]
    assert {s.chunk_size for sub, s in parsed.values() if sub in ("worker", "proxy")} == {chunk}


VLLM_EXAMPLES = [p for p in EXAMPLES
                 if yaml.safe_load(p.read_text())["spec"]["engine"]["type"] == "vllm"]


@pytest.mark.parametrize("path", VLLM_EXAMPLES, ids=[p.name for p in VLLM_EXAMPLES])
def test_vllm_pods_hand_kv_to_their_own_kv_server(path):
    """p2p, the vLLM examples' backend: the worker's LMCache remote and the server's API are
    the kvserver container beside it, on the ports that container listens on."""
    inst, children = render(path)
    assert inst.spec["kvCache"]["transferBackend"] == "p2p"
    for sts in pools(inst, children):
        worker, server = sts["spec"]["template"]["spec"]["containers"]
        _, settings = parse_agentserving(worker)
        assert settings.kv_transfer_p2p is True
        argv = pod_argv(server)
        assert argv[:2] == ["agentserving", "kvserver"] and server["name"] == "kvserver"
        ports = {p["containerPort"] for p in server["ports"]}
        assert settings.kv_transfer_url == f"lm://127.0.0.1:{flag(argv, '--port')}"
        assert settings.kv_server_api == f"http://127.0.0.1:{flag(argv, '--api-port')}"
        assert {int(flag(argv, "--port")), int(flag(argv, "--api-port"))} == ports
        assert float(flag(argv, "--max-gib")) == inst.spec["kvCache"]["transferGiB"]
        assert flag(argv, "--host") == "0.0.0.0"  # the decode pods pull from its pod IP
        from agentserving.engine.kvserver.settings import KvServerSettings

        sub, params = parse_agentserving(server)  # the real kvserver command takes it
        kvs = KvServerSettings(**params) if isinstance(params, dict) else params
        assert sub == "kvserver" and kvs.max_gib == inst.spec["kvCache"]["transferGiB"]
        assert (kvs.port, kvs.api_port) == (int(flag(argv, "--port")),
                                            int(flag(argv, "--api-port")))


# Reference pods run the pool's policy under the ShadowScheduler (vLLM pods: test_builders)
REFERENCE_EXAMPLES = [p for p in EXAMPLES
                      if yaml.safe_load(p.read_text())["spec"]["engine"]["type"] == "reference"]


@pytest.mark.parametrize("path", REFERENCE_EXAMPLES, ids=[p.name for p in REFERENCE_EXAMPLES])
def test_reference_worker_runs_the_pools_scheduler_policy(path):
    inst, children = render(path)
    from agentserving.engine.scheduler.registry import make_policy

    for sts in pools(inst, children):
        role = sts["metadata"]["name"].rsplit("-", 1)[1]
        _, settings = parse_agentserving(sts["spec"]["template"]["spec"]["containers"][0])
        policy = make_policy(settings.scheduler_policy, settings.prefill_chunk_tokens)
        lookahead = inst.spec["kvCache"]["prefetch"]["lookahead"]
        assert settings.scheduler_policy == (
            f"{inst.spec[role]['schedulerPolicy']}?lookahead={lookahead}")
        assert policy.shadow is not None and policy.shadow.lookahead == lookahead


@pytest.mark.parametrize("path", EXAMPLES, ids=IDS)
def test_every_example_model_loads_with_the_workers_own_loader(path, tmp_path):
    """The model the pods name, resolved by the code the pod runs: the reference worker's
    loader (and tokenizer) for real; for vLLM what the worker hands ``vllm serve``, which must
    be a Hugging Face id or a path (this test renders the command; it starts no vLLM)."""
    from huggingface_hub.utils import validate_repo_id

    inst, children = render(path)
    engine = inst.spec["engine"]["type"]
    for sts in pools(inst, children):
        container = sts["spec"]["template"]["spec"]["containers"][0]
        if engine == "reference":
            from agentserving.engine.model.loader import load_model
            from agentserving.engine.model.tokenizer import load_tokenizer

            _, settings = parse_agentserving(container)
            bundle = load_model(settings.model, seed=settings.seed,
                                max_model_len=settings.max_model_len)
            assert bundle.max_model_len == inst.spec["model"]["maxContext"]
            assert load_tokenizer(settings.model).encode("hello")
            continue
        if engine == "vllm":
            from agentserving.engine.vllm.serve_command import build, model_source

            _, settings = parse_agentserving(container)
            argv = build(settings).argv
            model = model_source(settings)
            assert argv[argv.index("serve") + 1] == model
            if inst.spec["model"]["name"] == "tiny":  # the seeded folder the worker writes
                from transformers import AutoConfig, AutoTokenizer

                from agentserving.engine.model.folder import write_model_folder
                from agentserving.engine.model.folders import MODEL_CACHE

                assert model == str(MODEL_CACHE / f"tiny-seed{settings.seed}")
                folder = write_model_folder(tmp_path / "tiny", seed=settings.seed)
                assert AutoConfig.from_pretrained(folder).model_type == "llama"
                assert AutoTokenizer.from_pretrained(folder)("hello")["input_ids"]
                continue
            if inst.spec["model"]["name"] == "smollm2":  # converted once, in the image
                from agentserving.engine.model.folders import folder_of

                assert model == str(folder_of("smollm2"))
                continue
        else:
            argv = pod_argv(container)
            model = argv[2]
        assert model == inst.spec["model"]["name"]
        if not PurePosixPath(model).is_absolute():
            validate_repo_id(model)


@pytest.mark.parametrize("path", EXAMPLES, ids=IDS)
def test_worker_pods_bind_every_interface_and_register_their_pod_ip(path):
    from agentserving.engine.worker import registration

    inst, children = render(path)
    engine = inst.spec["engine"]["type"]
    for sts in pools(inst, children):
        containers = sts["spec"]["template"]["spec"]["containers"]
        worker = containers[0]
        ip = next(e for e in worker["env"] if e["name"] == "POD_IP")
        assert ip["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        if engine == "vllm-ascend":  # vllm serve itself; the registrar registers the pod
            assert flag(pod_argv(worker), "--host") == "0.0.0.0"
            reg = registrar_args(containers[1]).registration()
            assert reg.api_url == f"http://{POD_IP}:8000"
            assert reg.memory_api_url == f"http://{POD_IP}:6999"
            continue
        _, settings = parse_agentserving(worker)
        assert settings.host == "0.0.0.0"
        assert settings.public_host == POD_IP
        if engine == "reference":
            reg = registration(settings, NoEngines())
            assert reg.api_url == f"http://{POD_IP}:8000"
            assert reg.memory_api_url == f"http://{POD_IP}:6999"
        else:
            from agentserving.engine.vllm.serve_command import build
            from agentserving.engine.vllm.settings import parse_settings

            argv = build(settings).argv
            assert flag(argv, "--host") == "0.0.0.0"
            extra = json.loads(flag(argv, "--kv-transfer-config"))["kv_connector_extra_config"]
            assert parse_settings(extra, container_env(worker)).public_host == POD_IP


class NoEngines:
    """The engine client as far as the registration reads it."""

    def capacity_bytes(self):
        return {}


@pytest.mark.parametrize("args, api_url", [
    (["--host", "0.0.0.0", "--advertise-host", "10.9.8.7", "--port", "8123"],
     "http://10.9.8.7:8123"),
    (["--host", "192.168.0.4", "--port", "8123"], "http://192.168.0.4:8123"),
    (["--host", "0.0.0.0"], "http://127.0.0.1:8000"),  # nothing to advertise: loopback
])
def test_registration_advertises_the_given_host(args, api_url):
    from agentserving.engine.worker import registration

    container = {"command": ["agentserving", "worker", *args]}
    _, settings = parse_agentserving(container)
    reg = registration(settings, NoEngines())
    assert reg.api_url == api_url
    assert reg.memory_api_url == api_url.rsplit(":", 1)[0] + ":6999"


@pytest.mark.parametrize("path", EXAMPLES, ids=IDS)
def test_every_mounted_config_file_is_read_by_the_pods_process(path):
    inst, children = render(path)
    engine = inst.spec["engine"]["type"]
    configmaps = {c["metadata"]["name"]: c for c in children if c["kind"] == "ConfigMap"}
    mounted = set()
    for sts in pools(inst, children):
        pod = sts["spec"]["template"]["spec"]
        volumes = {v["name"]: v["configMap"]["name"] for v in pod["volumes"] if "configMap" in v}
        for container in pod["containers"]:
            env = container_env(container)
            for mount in container.get("volumeMounts", []):
                if mount["name"] not in volumes:
                    continue
                for key in configmaps[volumes[mount["name"]]]["data"]:
                    file = f"{mount['mountPath']}/{key}"
                    readers = [v for v, p in env.items() if p == file
                               and engine in FILE_READERS.get(v, ())]
                    assert readers, f"{container['name']}: nothing reads {file}"
                    mounted.add(volumes[mount["name"]])
    assert mounted == set(configmaps)  # and no ConfigMap nobody mounts


def test_chunk_align_and_direct_disk_io_reach_the_vllm_prefill_pods_scheduler_and_lmcache():
    from agentserving.operator.builders.common import SpecError

    from .operator_testing import vllm_serve_of

    doc = yaml.safe_load((EXAMPLES[0].parent / "agentserving-vllm-cpu.yaml").read_text())
    spec = doc["spec"]
    spec["prefill"].update(schedulerPolicy="longcap-dynamic", chunkAlign=128)
    spec["kvCache"]["diskIO"] = "direct"
    inst = Instance("demo", "ns1", "uid-1", defaulted(spec))
    by_role = {sts["metadata"]["name"].rsplit("-", 1)[1]: sts["spec"]["template"]["spec"][
        "containers"][0] for sts in pools(inst, build_children(inst, OperatorSettings()))}
    prefill = vllm_serve_of(by_role["prefill"])
    assert flag(by_role["prefill"]["command"], "--chunk-align") == "128"
    assert "chunk_align=128" in prefill["env"]["AGENTSERVING_PREFILL_POLICY"]
    assert json.loads(prefill["env"]["LMCACHE_EXTRA_CONFIG"]) == {"use_odirect": True}
    assert "--chunk-align" not in by_role["decode"]["command"]  # the decode pool's own
    # vLLM's own scheduler cannot align: refused, naming the field
    spec["prefill"]["schedulerPolicy"] = "fcfs"
    with pytest.raises(SpecError, match=r"spec\.prefill\.chunkAlign"):
        build_children(Instance("demo", "ns1", "uid-1", defaulted(spec)), OperatorSettings())
