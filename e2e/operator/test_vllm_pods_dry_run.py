"""The operator's vLLM and vLLM-Ascend pods against the real API server: every child of the
examples and of seed 000's settings (``kubectl apply --dry-run=server``), plus each pool's pod
template as a bare Pod, so the API server validates the pod spec itself (containers, the
registrar sidecar, the vLLM pods' KV server, env references, Ascend host mounts, accelerator
resources). The spec is the one the API server stores: the AgentServing resource is dry-run
applied first and the CRD's defaults come back with it."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import yaml

from agentserving.operator.builders import Instance, build_children
from agentserving.operator.settings import OperatorSettings

from ..k8s.cluster import REPO

NS = "vllm-dry-run"


def _operator_testing():  # tests/operator/operator_testing.py (no package to import from)
    spec = importlib.util.spec_from_file_location(
        "agentserving_operator_testing", REPO / "tests" / "operator" / "operator_testing.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def vllm_serve_of(container: dict) -> dict:
    return _operator_testing().vllm_serve_of(container)


def _seed_spec(engine: str) -> dict:
    """The seed-000 spec the operator's unit tests check (tests/operator/seed000.py)."""
    spec = importlib.util.spec_from_file_location(
        "agentserving_seed000", REPO / "tests" / "operator" / "seed000.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.seed_spec(engine)


CASES = {
    "example-vllm": lambda: yaml.safe_load((REPO / "examples" / "agentserving-vllm.yaml")
                                           .read_text()),
    "example-vllm-ascend": lambda: yaml.safe_load(
        (REPO / "examples" / "agentserving-vllm-ascend.yaml").read_text()),
    "seed000-vllm-ascend": lambda: {"apiVersion": "agentserving.io/v1alpha1",
                                    "kind": "AgentServing", "metadata": {"name": "glm"},
                                    "spec": _seed_spec("vllm-ascend")},
    "seed000-vllm": lambda: {"apiVersion": "agentserving.io/v1alpha1", "kind": "AgentServing",
                             "metadata": {"name": "glm-nv"}, "spec": _seed_spec("vllm")},
}


@pytest.fixture(scope="module")
def namespace(cluster, crd):
    cluster.kubectl("create", "namespace", NS)
    return NS


def stored(cluster, body: dict) -> dict:
    """The resource as the API server would store it (schema validation + defaults)."""
    out = cluster.kubectl("apply", "--dry-run=server", "-n", NS, "-o", "json", "-f", "-",
                          input=json.dumps(body)).stdout
    obj = json.loads(out)
    obj["metadata"].setdefault("uid", "00000000-0000-0000-0000-000000000001")
    obj["metadata"].setdefault("namespace", NS)
    return obj


def as_pod(sts: dict) -> dict:
    """Pod 0 of a StatefulSet, as its controller would create it (claims become volumes)."""
    tmpl = sts["spec"]["template"]
    name = f"{sts['metadata']['name']}-0"
    spec = dict(tmpl["spec"])
    spec["volumes"] = list(spec.get("volumes", [])) + [
        {"name": c["metadata"]["name"],
         "persistentVolumeClaim": {"claimName": f"{c['metadata']['name']}-{name}"}}
        for c in sts["spec"].get("volumeClaimTemplates", [])]
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": NS, "labels": tmpl["metadata"]["labels"]},
            "spec": spec}


@pytest.mark.parametrize("case", sorted(CASES))
def test_rendered_vllm_children_pass_server_dry_run(cluster, namespace, case):
    obj = stored(cluster, CASES[case]())
    engine = obj["spec"]["engine"]["type"]
    assert engine in ("vllm", "vllm-ascend")
    kids = build_children(Instance.from_body(obj), OperatorSettings())
    pods = [as_pod(k) for k in kids if k["kind"] == "StatefulSet"]
    assert len(pods) == 2
    for k in kids:  # the owner does not exist in a dry run: the reference is not checked
        k["metadata"]["namespace"] = NS
    docs = {"apiVersion": "v1", "kind": "List", "items": kids + pods}
    out = cluster.kubectl("apply", "--dry-run=server", "-n", NS, "-f", "-",
                          input=json.dumps(docs)).stdout
    assert out.count("(server dry run)") == len(kids) + len(pods), out
    for pod in pods:
        assert f"pod/{pod['metadata']['name']} created (server dry run)" in out
        worker = pod["spec"]["containers"][0]
        if engine == "vllm":  # agentserving worker --engine vllm: the vllm serve it runs
            cmd = vllm_serve_of(worker)["argv"]
            assert cmd[2:4] == ["agentserving.engine.vllm.launch", "serve"]
        else:
            cmd = worker["command"]
            assert cmd[:2] == ["vllm", "serve"]
        ktc = json.loads(cmd[cmd.index("--kv-transfer-config") + 1])
        assert ktc["kv_connector"] == ("AgentServingConnectorV1" if engine == "vllm"
                                       else "LMCacheAscendConnectorV1Dynamic")
        names = [c["name"] for c in pod["spec"]["containers"]]
        # vLLM: the pod's own KV server (p2p, the default) beside the worker
        assert names == (["worker", "kvindex-registrar"] if engine == "vllm-ascend"
                         else ["worker", "kvserver"])
    # nothing was created
    assert cluster.get_json("statefulsets", "-n", NS)["items"] == []


def test_seed_cases_exist():
    assert Path(REPO / "tests" / "operator" / "seed000_serve.txt").exists()
