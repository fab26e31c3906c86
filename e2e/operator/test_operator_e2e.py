"""The operator against a real kube-apiserver + etcd + kube-controller-manager.

The operator runs as a real process with the chart's ServiceAccount token (RBAC mode), so
every reconcile here also proves the chart grants enough and no more is needed.
"""

from __future__ import annotations

import base64
import json
import time
import urllib.request

import pytest
import yaml

from agentserving.operator.builders import Instance, build_children
from agentserving.operator.settings import OperatorSettings

from ..k8s.cluster import REPO, wait_for
from .conftest import CHART, HUNG_PREFIX, OPERATOR_NAMESPACE, helm

EXAMPLES = sorted((REPO / "examples").glob("agentserving-*.yaml"))
CHILD_KINDS = "configmaps,services,statefulsets,deployments"
WAIT = 60
# The reference example's children: two pools (StatefulSet + Service each), the kvindex and the
# proxy (Deployment + Service each); its engine reads no ConfigMap.
REFERENCE_CHILDREN = 8


def load(path) -> dict:
    return yaml.safe_load(path.read_text())


def children(cluster, ns: str, name: str) -> dict[tuple[str, str], dict]:
    items = cluster.get_json(CHILD_KINDS, "-n", ns, "-l",
                             f"app.kubernetes.io/instance={name},"
                             "app.kubernetes.io/managed-by=agentserving-operator")["items"]
    return {(i["kind"], i["metadata"]["name"]): i for i in items}


def expected_children(resource: dict) -> set[tuple[str, str]]:
    """What the pure builders want for the resource as the API server stored it (defaults
    applied by the CRD's schema)."""
    return {(c["kind"], c["metadata"]["name"])
            for c in build_children(Instance.from_body(resource), OperatorSettings())}


def get_resource(cluster, ns: str, name: str) -> dict:
    return cluster.get_json("agentserving", name, "-n", ns)


def condition(resource: dict, ctype: str) -> dict:
    return next((c for c in (resource.get("status") or {}).get("conditions", [])
                 if c["type"] == ctype), {})


def wait_reconciled(cluster, ns: str, name: str, timeout: float = WAIT) -> dict:
    """The resource once the operator has written a status for its current generation."""
    def done():
        r = get_resource(cluster, ns, name)
        status = r.get("status") or {}
        return r if status.get("observedGeneration") == r["metadata"]["generation"] else None
    return wait_for(done, timeout, f"status of {ns}/{name}")


def create(cluster, ns: str, manifest: str) -> None:
    cluster.kubectl("create", "namespace", ns)
    cluster.kubectl("apply", "-n", ns, "-f", "-", input=manifest)


def pods(cluster, ns: str, component: str) -> list[dict]:
    return cluster.get_json("pods", "-n", ns, "-l",
                            f"app.kubernetes.io/component={component}")["items"]


def test_crd_is_established_with_short_name_and_printer_columns(cluster, crd):
    got = cluster.get_json("crd", crd)
    established = {c["type"]: c["status"] for c in got["status"]["conditions"]}
    assert established["Established"] == "True"
    assert got["spec"]["names"]["shortNames"] == ["asv"]
    version = got["spec"]["versions"][0]
    assert version["subresources"]["status"] == {}
    assert version["subresources"]["scale"]["specReplicasPath"] == ".spec.decode.replicas"
    out = cluster.kubectl("get", "asv", "-A").stderr
    assert "No resources found" in out


INVALID = [
    ("bad-engine", {"model": {"name": "m"}, "engine": {"type": "tensorrt"}}, "spec.engine.type"),
    ("bad-replicas", {"model": {"name": "m"}, "prefill": {"replicas": -1}},
     "spec.prefill.replicas"),
    ("no-model", {"engine": {"type": "reference"}}, "spec.model"),
    ("bad-redis", {"model": {"name": "m"}, "kvindex": {"redis": {"url": "http://redis:6379"}}},
     "spec.kvindex.redis.url"),
    ("bad-redis-replicas", {"model": {"name": "m"}, "kvindex": {"redis": {
        "inCluster": True, "replicas": 0}}}, "spec.kvindex.redis.replicas"),
    ("bad-accelerator", {"model": {"name": "m"}, "decode": {"accelerator": {"type": "tpu"}}},
     "spec.decode.accelerator.type"),
    ("bad-chunk", {"model": {"name": "m"}, "kvCache": {"chunkSize": 0}}, "spec.kvCache.chunkSize"),
    ("a" * 41, {"model": {"name": "m"}}, "metadata.name"),
]


@pytest.mark.parametrize("name, spec, field", INVALID, ids=[i[2] for i in INVALID])
def test_invalid_resource_is_rejected_naming_the_field(cluster, crd, name, spec, field):
    manifest = {"apiVersion": "agentserving.io/v1alpha1", "kind": "AgentServing",
                "metadata": {"name": name, "namespace": "default"}, "spec": spec}
    # --validate=false: the API server's schema must reject it (kubectl's own check, once the
    # CRD's OpenAPI is published, answers first with another message, depending on timing)
    proc = cluster.kubectl("apply", "--validate=false", "-f", "-", input=json.dumps(manifest),
                           check=False)
    assert proc.returncode != 0
    assert "is invalid" in proc.stderr
    assert field in proc.stderr, proc.stderr
    gone = cluster.kubectl("get", "asv", name, "-n", "default", check=False)
    assert gone.returncode != 0 and "NotFound" in gone.stderr


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_creates_every_child_with_owner_and_honest_status(cluster, operator, example):
    ns = f"e2e-{example.stem.removeprefix('agentserving-')}"
    name = load(example)["metadata"]["name"]
    create(cluster, ns, example.read_text())
    resource = get_resource(cluster, ns, name)
    want = expected_children(resource)
    got = wait_for(lambda: (c := children(cluster, ns, name)) and set(c) == want and c, WAIT,
                   f"children of {ns}/{name}")
    uid = resource["metadata"]["uid"]
    for obj in got.values():
        [owner] = obj["metadata"]["ownerReferences"]
        assert owner["uid"] == uid
        assert owner["kind"] == "AgentServing" and owner["controller"] is True

    # Pods exist (the controller-manager creates them) but stay Pending: no kubelet here.
    replicas = resource["spec"]["decode"]["replicas"]
    decode = wait_for(lambda: len(p := pods(cluster, ns, "decode")) == replicas and p, WAIT,
                      "decode pods")
    assert all(p["status"].get("phase") == "Pending" for p in decode)
    resource = wait_reconciled(cluster, ns, name)
    status = resource["status"]
    assert status["phase"] == "Pending"
    assert condition(resource, "Ready")["status"] == "False"
    assert condition(resource, "Ready")["reason"] == "ComponentsNotReady"
    assert condition(resource, "Progressing")["status"] == "True"
    assert condition(resource, "Degraded")["status"] == "False"
    assert status["decode"]["readyReplicas"] == 0
    assert status["decode"]["replicas"] == resource["spec"]["decode"]["replicas"]
    assert status["endpoint"] == f"http://{name}-proxy.{ns}.svc:8080/v1"
    # Printer columns show the phase and the ready counts.
    row = cluster.kubectl("get", "asv", name, "-n", ns, "--no-headers").stdout.split()
    assert row[:4] == [name, resource["spec"]["model"]["name"],
                       resource["spec"]["engine"]["type"], "Pending"]
    assert row[4:6] == [f"0/{resource['spec']['prefill']['replicas']}",
                        f"0/{resource['spec']['decode']['replicas']}"]


@pytest.fixture(scope="module")
def scaled_ns(cluster, operator):
    ns, name = "e2e-scale", "tiny-agent"
    create(cluster, ns, (REPO / "examples" / "agentserving-reference.yaml").read_text())
    wait_for(lambda: len(children(cluster, ns, name)) == REFERENCE_CHILDREN, WAIT, "children")
    wait_reconciled(cluster, ns, name)
    return ns, name


def test_replicas_change_scales_only_that_pool(cluster, scaled_ns):
    ns, name = scaled_ns
    before = children(cluster, ns, name)
    cluster.kubectl("patch", "agentserving", name, "-n", ns, "--type=merge",
                    "-p", json.dumps({"spec": {"prefill": {"replicas": 2}}}))
    wait_for(lambda: children(cluster, ns, name)[("StatefulSet", f"{name}-prefill")]["spec"][
        "replicas"] == 2, WAIT, "the prefill StatefulSet to scale")
    resource = wait_reconciled(cluster, ns, name)
    after = children(cluster, ns, name)
    for key, obj in before.items():
        if key == ("StatefulSet", f"{name}-prefill"):
            assert after[key]["metadata"]["generation"] == obj["metadata"]["generation"] + 1
            continue
        # Re-applied, but untouched: server-side apply of an unchanged manifest is a no-op.
        assert after[key]["metadata"].get("generation") == obj["metadata"].get("generation"), key
        if key[0] in ("ConfigMap", "Service"):
            assert after[key]["metadata"]["resourceVersion"] == obj["metadata"][
                "resourceVersion"], key
    assert after[("StatefulSet", f"{name}-decode")]["spec"]["replicas"] == 2
    assert resource["status"]["prefill"]["replicas"] == 2
    wait_for(lambda: len(pods(cluster, ns, "prefill")) == 2, WAIT, "a second prefill pod")


def test_scale_subresource_scales_the_decode_pool(cluster, scaled_ns):
    ns, name = scaled_ns
    cluster.kubectl("scale", "agentserving", name, "-n", ns, "--replicas=3")
    wait_for(lambda: children(cluster, ns, name)[("StatefulSet", f"{name}-decode")]["spec"][
        "replicas"] == 3, WAIT, "the decode StatefulSet to scale")
    resource = wait_reconciled(cluster, ns, name)
    assert resource["status"]["decode"]["replicas"] == 3
    assert resource["status"]["decode"]["selector"].endswith("app.kubernetes.io/component=decode")


def test_status_turns_ready_only_when_pods_are_ready(cluster, scaled_ns):
    """Play the kubelet: mark every pod Running and Ready; the controllers count them and the
    operator reports Ready. Before that it must not."""
    ns, name = scaled_ns
    assert get_resource(cluster, ns, name)["status"]["phase"] != "Ready"
    wanted = sum(obj["spec"]["replicas"] for (kind, _), obj in children(cluster, ns, name).items()
                 if kind in ("StatefulSet", "Deployment"))
    wait_for(lambda: len(cluster.get_json("pods", "-n", ns)["items"]) == wanted, WAIT,
             "all pods")
    ready = {"status": {"phase": "Running", "conditions": [
        {"type": "Ready", "status": "True"}, {"type": "ContainersReady", "status": "True"}]}}
    for pod in cluster.get_json("pods", "-n", ns)["items"]:
        cluster.kubectl("patch", "pod", pod["metadata"]["name"], "-n", ns, "--subresource=status",
                        "--type=merge", "-p", json.dumps(ready))

    def is_ready():
        r = get_resource(cluster, ns, name)
        return r if r["status"]["phase"] == "Ready" else None
    resource = wait_for(is_ready, WAIT, "phase Ready")
    assert condition(resource, "Ready")["status"] == "True"
    assert condition(resource, "Ready")["reason"] == "AllComponentsReady"
    assert condition(resource, "Progressing")["status"] == "False"
    decode = resource["status"]["decode"]
    assert decode["ready"] == f"{decode['replicas']}/{decode['replicas']}"


def test_unservable_spec_is_degraded_with_the_field_named(cluster, operator):
    ns, name = "e2e-degraded", "two-memory-indexes"
    manifest = {"apiVersion": "agentserving.io/v1alpha1", "kind": "AgentServing",
                "metadata": {"name": name},
                "spec": {"model": {"name": "tiny"}, "kvindex": {"replicas": 2}}}
    create(cluster, ns, json.dumps(manifest))
    resource = wait_reconciled(cluster, ns, name)
    assert resource["status"]["phase"] == "Degraded"
    assert condition(resource, "Degraded")["reason"] == "InvalidSpec"
    assert "spec.kvindex.replicas" in condition(resource, "Degraded")["message"]
    assert children(cluster, ns, name) == {}


def test_in_cluster_redis_with_sentinel_and_back_to_one(cluster, operator):
    """redis.replicas 3: a StatefulSet (pods with a redis and a sentinel container), its
    headless Service, the sentinels' Service and the ConfigMap, accepted by a real API
    server; the status counts the StatefulSet. Back to 1: those are pruned and the single
    Deployment returns."""
    ns, name = "e2e-redis-ha", "ha"
    doc = load(REPO / "examples" / "agentserving-reference.yaml")
    doc["metadata"]["name"] = name
    doc["spec"]["kvindex"] = {"replicas": 2, "redis": {"inCluster": True, "replicas": 3}}
    create(cluster, ns, json.dumps(doc))
    want = expected_children(get_resource(cluster, ns, name))
    assert {("StatefulSet", f"{name}-redis"), ("Service", f"{name}-redis-headless"),
            ("Service", f"{name}-redis-sentinel"), ("ConfigMap", f"{name}-redis")} <= want
    got = wait_for(lambda: (c := children(cluster, ns, name)) and set(c) == want and c, WAIT,
                   f"children of {ns}/{name}")
    assert got[("Service", f"{name}-redis-headless")]["spec"]["clusterIP"] == "None"
    assert got[("StatefulSet", f"{name}-redis")]["spec"]["replicas"] == 3
    # OrderedReady: pod 0 only, until it is Ready (never, without a kubelet)
    redis_pods = wait_for(lambda: (p := pods(cluster, ns, "redis")) and p, WAIT, "redis pod 0")
    assert [p["metadata"]["name"] for p in redis_pods] == [f"{name}-redis-0"]
    assert [c["name"] for c in redis_pods[0]["spec"]["containers"]] == ["redis", "sentinel"]
    status = wait_reconciled(cluster, ns, name)["status"]
    assert status["redis"]["replicas"] == 3 and status["redis"]["readyReplicas"] == 0
    cluster.kubectl("patch", "agentserving", name, "-n", ns, "--type=merge",
                    "-p", json.dumps({"spec": {"kvindex": {"redis": {"replicas": 1}}}}))
    resource = wait_for(lambda: (r := wait_reconciled(cluster, ns, name))["metadata"][
        "generation"] == 2 and r, WAIT, "generation 2 applied")
    want = expected_children(resource)
    assert ("Deployment", f"{name}-redis") in want and ("StatefulSet", f"{name}-redis") not in want
    wait_for(lambda: set(children(cluster, ns, name)) == want, WAIT, "the Sentinel set pruned")
    assert resource["status"]["redis"]["replicas"] == 1


def test_delete_forgets_kvindex_pods_and_collects_children(cluster, operator, fake_kvindex):
    ns, name = "e2e-delete", "doomed"
    doc = load(REPO / "examples" / "agentserving-reference.yaml")
    doc["metadata"]["name"] = name
    create(cluster, ns, json.dumps(doc))
    wait_for(lambda: len(children(cluster, ns, name)) == REFERENCE_CHILDREN, WAIT, "children")
    wait_for(lambda: len(pods(cluster, ns, "decode")) == 2, WAIT, "decode pods")
    resource = get_resource(cluster, ns, name)
    assert "agentserving.io/finalizer" in resource["metadata"]["finalizers"]
    # the operator made the components' internal token, and calls the kvindex with it
    secret = cluster.get_json("secret", f"{name}-internal", "-n", ns)
    token = base64.b64decode(secret["data"]["token"]).decode()
    assert secret["metadata"]["ownerReferences"][0]["uid"] == resource["metadata"]["uid"]
    cluster.kubectl("delete", "agentserving", name, "-n", ns, "--wait=false")
    wait_for(lambda: cluster.kubectl("get", "asv", name, "-n", ns, check=False).returncode != 0,
             WAIT, "the resource to go")
    assert sorted(pod for (n_, r_, pod) in fake_kvindex.deleted if (n_, r_) == (ns, name)) == [
        f"{name}-decode-0", f"{name}-decode-1", f"{name}-prefill-0"]
    assert fake_kvindex.authorization[(ns, name)] == f"Bearer {token}"
    # ownerReferences: the controller-manager's garbage collector removes every child.
    wait_for(lambda: children(cluster, ns, name) == {}, WAIT, "children to be collected")
    wait_for(lambda: cluster.get_json("pods", "-n", ns)["items"] == [], WAIT, "pods to go")
    wait_for(lambda: cluster.kubectl("get", "secret", f"{name}-internal", "-n", ns,
                                     check=False).returncode != 0, WAIT, "the secret to go")


def test_hung_kvindex_does_not_block_deletion(cluster, operator, fake_kvindex):
    ns, name = "e2e-hung", f"{HUNG_PREFIX}agent"
    create(cluster, ns, json.dumps({"apiVersion": "agentserving.io/v1alpha1",
                                    "kind": "AgentServing", "metadata": {"name": name},
                                    "spec": {"model": {"name": "tiny"}}}))
    wait_reconciled(cluster, ns, name)
    started = time.monotonic()
    cluster.kubectl("delete", "agentserving", name, "-n", ns, "--wait=false")
    wait_for(lambda: cluster.kubectl("get", "asv", name, "-n", ns, check=False).returncode != 0,
             WAIT, "the resource to go despite a hung kvindex")
    assert time.monotonic() - started < 20
    assert (ns, name) in fake_kvindex.listed


def test_chart_renders_and_applies_with_server_dry_run(cluster, binaries, crd):
    lint = helm(binaries, "lint", str(CHART), "--strict")
    assert "0 chart(s) failed" in lint
    cluster.kubectl("create", "namespace", "dry-run-a")
    cluster.kubectl("create", "namespace", "dry-run-b")
    for extra in ([], ["--set", "networkPolicy.enabled=true",
                       "--set", "watchNamespaces={dry-run-a,dry-run-b}"]):
        rendered = helm(binaries, "template", "as-dry", str(CHART), "--namespace", "default",
                        "--include-crds", *extra)
        kinds = {d["kind"] for d in yaml.safe_load_all(rendered) if d}
        assert {"CustomResourceDefinition", "Deployment", "ServiceAccount", "ClusterRole"} <= kinds
        out = cluster.kubectl("apply", "--dry-run=server", "-f", "-", input=rendered).stdout
        assert "deployment.apps/as-dry-agentserving created (server dry run)" in out
        assert "(server dry run)" in out
    # Dry run: nothing was created.
    gone = cluster.kubectl("get", "deployment", "as-dry-agentserving", "-n", "default",
                           check=False)
    assert gone.returncode != 0


def test_operator_identity_is_the_charts_service_account_not_admin(cluster, operator):
    kc = operator.kubeconfig
    can = lambda *a: cluster.kubectl("auth", "can-i", *a, kubeconfig=kc,  # noqa: E731
                                     check=False).stdout.strip()
    assert can("patch", "statefulsets.apps", "-n", "e2e-scale") == "yes"
    assert can("patch", "agentservings.agentserving.io/status", "-n", "e2e-scale") == "yes"
    assert can("get", "secrets", "-n", OPERATOR_NAMESPACE) == "no"
    # it writes each resource's token Secret, and reads none (it derives the token)
    assert can("create", "secrets", "-n", "e2e-scale") == "yes"
    assert can("get", "secrets", "-n", "e2e-scale") == "no"
    assert can("create", "pods", "-n", "e2e-scale") == "no"
    assert can("delete", "namespaces") == "no"
    assert "Forbidden" not in operator.log_text()


def test_operator_exposes_metrics_and_health(operator, scaled_ns):
    metrics = operator.metrics()
    applied = [line for line in metrics.splitlines()
               if line.startswith('agentserving_operator_reconciles_total{result="applied"}')]
    assert applied and float(applied[0].split()[-1]) >= 1
    assert "agentserving_operator_status_writes_total" in metrics
    with urllib.request.urlopen(operator.health_url, timeout=5) as r:
        assert r.status == 200
    # Structured logs: one JSON object per line.
    lines = [ln for ln in operator.log_text().splitlines() if ln.startswith("{")]
    assert lines and all("message" in json.loads(ln) for ln in lines[:20])
