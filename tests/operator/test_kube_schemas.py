"""What a current cluster accepts: the chart as ``helm template`` renders it (CRD included) and
every object the operator's pure builders produce, validated against the OpenAPI schemas of
Kubernetes 1.30 to the newest that ``kubernetes-validate`` ships (strict: an unknown field is
an error, as server-side apply with field validation makes it). The test node runs 1.20, so
an API version removed since (policy/v1beta1, autoscaling/v2beta2...) would pass every e2e
test there and be refused by a user's cluster; this is the check that sees it."""

from __future__ import annotations

import copy
import subprocess

import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import all_versions, major_minor

from agentserving.operator.builders import Instance, build_children
from agentserving.operator.settings import OperatorSettings

from .operator_testing import EXAMPLES, REPO, defaulted
from .test_grafana_dashboard import _helm

CHART = REPO / "charts" / "agentserving"
OLDEST_SUPPORTED = "1.30"
# every minor release from the oldest users run to the newest with shipped schemas
VERSIONS = sorted({major_minor(v) for v in all_versions()
                   if major_minor(v) >= major_minor(OLDEST_SUPPORTED)},
                  key=lambda v: tuple(map(int, v.split("."))))

# What the examples leave out but a cluster must still accept: the in-cluster Redis alone and
# with Sentinel, PVC-backed disk tiers, a LoadBalancer proxy, the vLLM pods' KV servers (each
# pod's own, and the central one).
VARIANTS = {
    "redis-in-cluster": {"model": {"name": "tiny"}, "kvindex": {"redis": {"inCluster": True}}},
    "redis-sentinel": {"model": {"name": "tiny"},
                       "kvindex": {"replicas": 2, "redis": {"inCluster": True, "replicas": 3}}},
    "pvc-disk-tier": {"model": {"name": "tiny"},
                      "kvCache": {"diskGiB": 5, "diskVolume": {"storageClassName": "fast"}}},
    "load-balancer": {"model": {"name": "tiny"}, "proxy": {"serviceType": "LoadBalancer"}},
    "vllm-default": {"model": {"name": "Qwen/Qwen2.5-7B-Instruct"}, "engine": {"type": "vllm"},
                     "prefill": {"accelerator": {"type": "nvidia"}},
                     "decode": {"accelerator": {"type": "nvidia"}}},
    "vllm-p2p": {"model": {"name": "Qwen/Qwen2.5-7B-Instruct"}, "engine": {"type": "vllm"},
                 "prefill": {"accelerator": {"type": "nvidia"}},
                 "decode": {"accelerator": {"type": "nvidia"}},
                 "kvCache": {"transferBackend": "p2p", "transferGiB": 0.75}},
    "vllm-lmcache-server": {"model": {"name": "Qwen/Qwen2.5-7B-Instruct"},
                            "engine": {"type": "vllm"},
                            "prefill": {"accelerator": {"type": "nvidia"}},
                            "decode": {"accelerator": {"type": "nvidia"}},
                            "kvCache": {"transferBackend": "lmcache-server", "transferGiB": 3}},
}
SPECS = {p.name: yaml.safe_load(p.read_text())["spec"] for p in EXAMPLES} | VARIANTS


def k8s_errors(obj: dict, version: str) -> str | None:
    """Why Kubernetes ``version`` refuses ``obj`` (None: it accepts it)."""
    try:
        kubernetes_validate.validate(copy.deepcopy(obj), version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        return f"{exc.message} at {'.'.join(map(str, exc.path))}"
    except kubernetes_validate.SchemaNotFoundError:
        return f"Kubernetes {version} has no {obj['apiVersion']} {obj['kind']}"
    return None


def refusals(objects: list[dict]) -> list[str]:
    return [f"{version}: {obj['kind']} {obj['metadata']['name']}: {err}"
            for obj in objects for version in VERSIONS
            if (err := k8s_errors(obj, version))]


def operator_children(spec: dict) -> list[dict]:
    settings = OperatorSettings(token_key="operator-key")  # the internal Secret too
    return build_children(Instance("demo", "ns1", "uid-1", defaulted(spec)), settings)


def helm_template(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(_helm()), "template", "r", str(CHART), "--namespace", "ops",
                           *args], capture_output=True, text=True, timeout=120)


def rendered_chart(*sets: str) -> list[dict]:
    proc = helm_template("--include-crds", *[a for s in sets for a in ("--set", s)])
    assert proc.returncode == 0, proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def test_the_schemas_cover_the_releases_users_run():
    assert VERSIONS[0] == OLDEST_SUPPORTED
    assert "1.35" in VERSIONS, f"kubernetes-validate ships schemas up to {VERSIONS[-1]} only"


@pytest.mark.parametrize("name", sorted(SPECS))
def test_every_object_the_operator_builds_is_accepted(name):
    children = operator_children(SPECS[name])
    assert {c["kind"] for c in children} >= {"StatefulSet", "Service", "Deployment", "Secret"}
    assert refusals(children) == []


@pytest.mark.parametrize("sets", [(), ("grafana.dashboard.enabled=true",
                                       "watchNamespaces={team-a,team-b}",
                                       "operator.extraEnv[0].name=X",
                                       "operator.extraEnv[0].value=x")],
                         ids=["defaults", "every-option"])
def test_the_rendered_chart_is_accepted(sets):
    docs = rendered_chart(*sets)
    kinds = {d["kind"] for d in docs}
    assert {"CustomResourceDefinition", "Deployment", "ClusterRole", "ServiceAccount",
            "NetworkPolicy", "Service"} <= kinds
    assert refusals(docs) == []


def test_the_check_refuses_an_api_version_a_current_cluster_removed():
    """Objects the 1.20 test node would still take: the check above must refuse them."""
    pdb = {"apiVersion": "policy/v1beta1", "kind": "PodDisruptionBudget",
           "metadata": {"name": "demo-decode"},
           "spec": {"minAvailable": 1, "selector": {"matchLabels": {"a": "b"}}}}
    hpa = {"apiVersion": "autoscaling/v2beta2", "kind": "HorizontalPodAutoscaler",
           "metadata": {"name": "demo-decode"},
           "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "StatefulSet",
                                       "name": "demo-decode"},
                    "minReplicas": 1, "maxReplicas": 2}}
    for obj in (pdb, hpa):
        assert len(refusals([obj])) == len(VERSIONS), obj["apiVersion"]
    # and a field the schema does not know (strict), in an otherwise valid child
    sts = next(c for c in operator_children({"model": {"name": "tiny"}})
               if c["kind"] == "StatefulSet")
    sts["spec"]["template"]["spec"]["containers"][0]["readinessProbes"] = {}
    assert len(refusals([sts])) == len(VERSIONS)


def test_the_chart_declares_the_oldest_kubernetes_it_installs_on():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["kubeVersion"] == ">=1.20.0-0"  # the test node (1.20) must still install it
    assert helm_template("--kube-version", "1.20.0").returncode == 0
    assert helm_template("--kube-version", VERSIONS[-1] + ".0").returncode == 0
    old = helm_template("--kube-version", "1.19.0")
    assert old.returncode != 0 and "kubeVersion" in old.stderr


def test_the_specs_reach_every_builder():
    """The objects validated above include what each builder makes (a builder no spec here
    reaches would go unchecked)."""
    children = [c for spec in SPECS.values() for c in operator_children(spec)]
    made = {(c["kind"], c["metadata"]["name"].removeprefix("demo-")) for c in children}
    assert {("ConfigMap", "config"), ("Secret", "internal"), ("StatefulSet", "prefill"),
            ("StatefulSet", "decode"), ("Service", "prefill"), ("Deployment", "kvindex"),
            ("Deployment", "proxy"), ("Deployment", "redis"), ("StatefulSet", "redis"),
            ("Service", "redis-sentinel"), ("ConfigMap", "redis"), ("Deployment", "kvserver"),
            ("Service", "kvserver")} <= made, sorted(made)
    # and the KV server beside a vLLM worker (p2p)
    assert any(c["name"] == "kvserver" for child in children if child["kind"] == "StatefulSet"
               for c in child["spec"]["template"]["spec"]["containers"])
