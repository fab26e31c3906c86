"""reconcile.py against an in-memory stand-in for the Kubernetes API (no cluster)."""

from __future__ import annotations

import base64
import copy
import dataclasses

import pytest
from kubernetes.client.exceptions import ApiException

from agentserving.operator import reconcile
from agentserving.operator.builders import SpecError, derive_token

from .operator_testing import defaulted


class FakeKube:
    def __init__(self):
        self.objects: dict[tuple[str, str, str], dict] = {}
        self.status_writes: list[tuple[dict, str | None]] = []
        self.conflicts = 0
        self.deleted: list[tuple[str, str]] = []
        self.resource: dict | None = None

    def apply(self, obj):
        key = (obj["kind"], obj["metadata"]["namespace"], obj["metadata"]["name"])
        stored = copy.deepcopy(obj)
        stored["metadata"]["generation"] = 1
        stored["status"] = {"observedGeneration": 1, "readyReplicas": 0}
        self.objects[key] = stored
        return stored

    def get(self, api_version, kind, namespace, name):
        if kind == "AgentServing":
            return copy.deepcopy(self.resource)
        return copy.deepcopy(self.objects.get((kind, namespace, name)))

    def list(self, api_version, kind, namespace, label_selector):
        return [copy.deepcopy(o) for (k, ns, _), o in self.objects.items()
                if k == kind and ns == namespace]

    def delete(self, api_version, kind, namespace, name):
        self.objects.pop((kind, namespace, name), None)
        self.deleted.append((kind, name))

    def patch_status(self, api_version, kind, namespace, name, status, resource_version=None):
        if self.conflicts:
            self.conflicts -= 1
            raise ApiException(status=409, reason="Conflict")
        self.status_writes.append((status, resource_version))
        self.resource["status"] = {k: v for k, v in {**self.resource.get("status", {}),
                                                     **status}.items() if v is not None}


def body(spec, generation=1):
    return {"metadata": {"name": "demo", "namespace": "ns1", "uid": "uid-1",
                         "generation": generation, "resourceVersion": "7"},
            "spec": defaulted(spec)}


def test_reconcile_applies_children_and_writes_pending_status(settings):
    kube = FakeKube()
    kube.resource = body({"model": {"name": "tiny"}})
    status = reconcile.reconcile(kube, settings, kube.resource)
    assert len(kube.objects) == 8  # 2 pools, kvindex, proxy: a workload + a Service each
    assert status["phase"] == "Pending"
    assert status["observedGeneration"] == 1
    written, rv = kube.status_writes[-1]
    assert written["phase"] == "Pending" and rv is None


def test_reconcile_prunes_what_the_spec_no_longer_wants(settings):
    kube = FakeKube()
    kube.resource = body({"model": {"name": "tiny"}, "kvindex": {"redis": {"inCluster": True}}})
    reconcile.reconcile(kube, settings, kube.resource)
    assert ("Deployment", "ns1", "demo-redis") in kube.objects
    kube.resource = body({"model": {"name": "tiny"}}, generation=2) | {
        "status": kube.resource["status"]}
    status = reconcile.reconcile(kube, settings, kube.resource)
    assert ("Deployment", "demo-redis") in kube.deleted
    assert ("Service", "demo-redis") in kube.deleted
    assert ("Deployment", "ns1", "demo-redis") not in kube.objects
    assert "redis" not in status
    assert kube.status_writes[-1][0]["redis"] is None  # removed from the stored status


def test_the_internal_token_is_a_child_the_same_on_every_pass(settings):
    """With the operator's token key, each resource gets its token's Secret; the token is
    derived, so a second pass (or a restarted operator) writes the same one, and the
    finalizer can derive it without reading any Secret."""
    keyed = dataclasses.replace(settings, token_key="operator-key")
    kube = FakeKube()
    kube.resource = body({"model": {"name": "tiny"}})
    reconcile.reconcile(kube, keyed, kube.resource)
    assert len(kube.objects) == 9  # and the Secret
    secret = kube.objects[("Secret", "ns1", "demo-internal")]
    token = base64.b64decode(secret["data"]["token"]).decode()
    assert token == derive_token("operator-key", "ns1", "demo", "uid-1") and len(token) >= 32
    assert secret["metadata"]["ownerReferences"][0]["uid"] == "uid-1"  # goes with the resource
    reconcile.reconcile(kube, keyed, kube.resource)
    assert kube.objects[("Secret", "ns1", "demo-internal")]["data"] == secret["data"]
    for kind, name in (("StatefulSet", "demo-prefill"), ("StatefulSet", "demo-decode"),
                       ("Deployment", "demo-kvindex"), ("Deployment", "demo-proxy")):
        container = kube.objects[(kind, "ns1", name)]["spec"]["template"]["spec"][
            "containers"][0]
        assert {"name": "AGENTSERVING_INTERNAL_TOKEN", "valueFrom": {"secretKeyRef": {
            "name": "demo-internal", "key": "token"}}} in container["env"], name
    # another key, another resource (or the same name made again: another uid): other tokens
    assert len({derive_token("operator-key", "ns1", "demo", "uid-1"),
                derive_token("other-key", "ns1", "demo", "uid-1"),
                derive_token("operator-key", "ns1", "demo", "uid-2"),
                derive_token("operator-key", "ns2", "demo", "uid-1")}) == 4


def test_prune_spares_objects_owned_by_someone_else(settings):
    kube = FakeKube()
    kube.resource = body({"model": {"name": "tiny"}})
    foreign = {"kind": "Deployment", "metadata": {"name": "demo-extra", "namespace": "ns1",
                                                  "ownerReferences": [{"uid": "other"}]}}
    kube.objects[("Deployment", "ns1", "demo-extra")] = foreign
    reconcile.reconcile(kube, settings, kube.resource)
    assert ("Deployment", "ns1", "demo-extra") in kube.objects


def test_invalid_spec_writes_degraded_and_raises(settings):
    kube = FakeKube()
    kube.resource = body({"model": {"name": "tiny"}, "kvindex": {"replicas": 3}})
    with pytest.raises(SpecError):
        reconcile.reconcile(kube, settings, kube.resource)
    assert kube.objects == {}
    written, _ = kube.status_writes[-1]
    assert written["phase"] == "Degraded"
    degraded = next(c for c in written["conditions"] if c["type"] == "Degraded")
    assert degraded["reason"] == "InvalidSpec"
    assert "spec.kvindex.replicas" in degraded["message"]


def test_vllm_pd_that_moves_no_kv_is_an_invalid_spec(settings):
    kube = FakeKube()
    kube.resource = body({"model": {"name": "m"}, "engine": {"type": "vllm"},
                          "kvCache": {"transferBackend": "tcp"}})
    with pytest.raises(SpecError):
        reconcile.reconcile(kube, settings, kube.resource)
    assert kube.objects == {}  # no pool that would recompute every prompt
    written, _ = kube.status_writes[-1]
    degraded = next(c for c in written["conditions"] if c["type"] == "Degraded")
    assert degraded["reason"] == "InvalidSpec"
    assert "spec.engine.type vllm" in degraded["message"]
    assert "spec.kvCache.transferBackend tcp" in degraded["message"]


def test_refresh_is_conditional_and_retries_on_conflict(settings):
    kube = FakeKube()
    kube.resource = body({"model": {"name": "tiny"}})
    reconcile.reconcile(kube, settings, kube.resource)
    kube.objects[("StatefulSet", "ns1", "demo-decode")]["status"]["readyReplicas"] = 1
    kube.conflicts = 1
    reconcile.refresh_status(kube, "ns1", "demo")
    written, rv = kube.status_writes[-1]
    assert rv == "7"
    assert written["decode"]["readyReplicas"] == 1
    assert kube.conflicts == 0


def test_refresh_skips_unreconciled_and_deleting_resources(settings):
    kube = FakeKube()
    kube.resource = body({"model": {"name": "tiny"}})
    reconcile.refresh_status(kube, "ns1", "demo")
    assert kube.status_writes == []
    kube.resource = None
    reconcile.refresh_status(kube, "ns1", "demo")
    assert kube.status_writes == []
