"""What a user gets from `helm install` + `kubectl apply -f examples/agentserving-reference.yaml`,
on a real node: real pods from the project's images, the operator in-cluster under its
ServiceAccount, the openai SDK through the proxy Service (port-forwarded to 127.0.0.1).

The tests run in file order and share the session's fixtures: each leaves the deployment
serving for the next, and the last one uninstalls it.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from ..k8s.polling import wait_for
from .conftest import (
    NAME,
    NAMESPACE,
    OPERATOR_NAMESPACE,
    RELEASE,
    Session,
    client,
    component_of,
    helm,
    pods,
    registered_pods,
    three_turns,
    wait_ready,
)

pytestmark = pytest.mark.timeout(900)

def test_every_pod_is_running_and_ready_and_the_operator_runs_in_cluster(node_cluster,
                                                                         reference):
    assert sorted({component_of(p) for p in reference}) == ["decode", "kvindex", "prefill",
                                                           "proxy"]
    operator = node_cluster.get_json("pods", "-n", OPERATOR_NAMESPACE)["items"]
    assert len(operator) == 1 and operator[0]["spec"]["serviceAccountName"] == RELEASE
    # It created every child, so it reached the API server from its pod with that account.
    owners = {ref["name"] for p in reference for ref in p["metadata"].get(
        "ownerReferences", [])}
    assert owners  # ReplicaSets of the operator's Deployments
    status = node_cluster.get_json("agentserving", NAME, "-n", NAMESPACE)["status"]
    assert status.get("phase") == "Ready", status


def test_three_turn_session_through_the_proxy_service(proxy_url, kvindex_url, reference,
                                                     internal_token):
    worker_pods = {p["metadata"]["name"] for p in reference
                   if component_of(p) in ("prefill", "decode")}
    # the pods hold the operator's token: they registered, and the proxy reads the index
    wait_for(lambda: registered_pods(kvindex_url, internal_token) >= worker_pods, 60,
             "every worker pod registered with the kvindex")
    # anyone else who reaches the kvindex is turned away
    assert httpx.get(kvindex_url + "/v1/pods", timeout=5).status_code == 401
    assert httpx.get(kvindex_url + "/v1/pods", timeout=5,
                     headers={"authorization": "Bearer guessed"}).status_code == 403
    turns = three_turns(client(proxy_url), "node-three-turns", seed=1)
    assert turns[0][0].usage.prompt_tokens_details.cached_tokens == 0
    served = [headers.get("x-agentserving-decode-pod")
              or headers.get("x-agentserving-prefill-pod") for _, headers in turns]
    assert set(served) <= worker_pods  # pods registered their own (pod IP) addresses


def test_a_deleted_decode_pod_does_not_end_the_session(node_cluster, proxy_url, reference):
    """Turns keep being answered while the session's decode pod terminates and after the
    StatefulSet has replaced it (same name, new pod)."""
    session = Session(client(proxy_url), "node-survivor", seed=2)
    session.next()
    _, headers = session.next()
    victim = headers.get("x-agentserving-decode-pod")
    assert victim, dict(headers)
    old_uid = node_cluster.get_json("pod", victim, "-n", NAMESPACE)["metadata"]["uid"]
    node_cluster.kubectl("delete", "pod", "-n", NAMESPACE, victim, "--wait=false")
    answered = [session.next()[0].choices[0].text for _ in range(3)]
    wait_for(lambda: node_cluster.get_json("pod", victim, "-n", NAMESPACE)["metadata"][
        "uid"] != old_uid, 120, f"{victim} replaced")
    wait_ready(node_cluster, {"kvindex": 1, "proxy": 1, "prefill": 1, "decode": 2})
    answered += [session.next()[0].choices[0].text for _ in range(2)]
    assert all(answered) and len(answered) == 5


def test_scaling_decode_adds_a_pod_that_registers_and_takes_sessions(
        node_cluster, proxy_url, kvindex_url, internal_token):
    before = {p["metadata"]["name"] for p in pods(node_cluster)
              if component_of(p) == "decode"}
    node_cluster.kubectl("patch", "agentserving", NAME, "-n", NAMESPACE, "--type=merge",
                         "-p", json.dumps({"spec": {"decode": {"replicas": 3}}}))
    now = wait_ready(node_cluster, {"kvindex": 1, "proxy": 1, "prefill": 1, "decode": 3})
    new = {p["metadata"]["name"] for p in now if component_of(p) == "decode"} - before
    assert len(new) == 1
    wait_for(lambda: registered_pods(kvindex_url, internal_token) >= new, 60,
             "the new decode pod registered")
    c = client(proxy_url)
    landed = set()
    for k in range(9):
        _, headers = Session(c, f"node-scale-{k}", seed=30 + k).next()
        landed.add(headers.get("x-agentserving-decode-pod"))
        if landed & new:
            break
    assert landed & new, landed


def test_changing_a_field_rolls_the_pools_without_a_failed_turn(node_cluster, proxy_url):
    before = {p["metadata"]["uid"] for p in pods(node_cluster)
              if component_of(p) in ("prefill", "decode")}
    c = client(proxy_url)
    failures: list[str] = []
    answered = [0]
    stop = threading.Event()

    def traffic() -> None:
        k = 0
        while not stop.is_set():
            session = Session(c, f"node-roll-{k}", seed=60 + k)
            for _ in range(3):
                try:
                    session.next()
                    answered[0] += 1
                except Exception as e:  # noqa: BLE001 - every failed turn is recorded
                    failures.append(repr(e))
            k += 1

    driver = threading.Thread(target=traffic, daemon=True)
    driver.start()
    try:
        node_cluster.kubectl("patch", "agentserving", NAME, "-n", NAMESPACE, "--type=merge",
                             "-p", json.dumps({"spec": {"kvCache": {"cpuGiB": 1}}}))

        def rolled():
            current = pods(node_cluster)
            workers = [p for p in current if component_of(p) in ("prefill", "decode")]
            return not ({p["metadata"]["uid"] for p in workers} & before) and workers
        wait_for(rolled, 300, "every worker pod replaced", interval=1)
        wait_ready(node_cluster, {"kvindex": 1, "proxy": 1, "prefill": 1, "decode": 3})
        time.sleep(3)  # a few turns on the new pods
    finally:
        stop.set()
        driver.join(timeout=180)
    assert answered[0] >= 3
    assert failures == [], failures


def test_helm_uninstall_leaves_nothing_behind(node_cluster):
    node_cluster.kubectl("delete", "agentserving", NAME, "-n", NAMESPACE, "--timeout=120s")
    helm(node_cluster, "uninstall", RELEASE, "--namespace", OPERATOR_NAMESPACE, "--wait",
         "--timeout", "120s")

    def leftovers() -> list[str]:
        left = []
        for kind in ("deployments", "replicasets", "pods", "services", "configmaps",
                     "serviceaccounts", "roles", "rolebindings"):
            for ns in (NAMESPACE, OPERATOR_NAMESPACE):
                items = node_cluster.get_json(kind, "-n", ns)["items"]
                left += [f"{kind}/{ns}/{i['metadata']['name']}" for i in items
                         if _ours(i)]
        for kind in ("clusterroles", "clusterrolebindings"):
            items = node_cluster.get_json(kind)["items"]
            left += [f"{kind}/{i['metadata']['name']}" for i in items if _ours(i)]
        return left
    wait_for(lambda: not leftovers(), 120, "every object of the release and the example "
             "deleted", interval=1)
    # Helm keeps the CRDs of a chart's crds/ folder on uninstall (its documented policy):
    # the user's custom resources are not deleted with the operator.
    assert node_cluster.get_json("crd", "agentservings.agentserving.io")
    # Nothing runs on the node any more but what the node itself keeps.
    tasks = node_cluster.node.ctr("tasks", "ls", "-q").stdout.split()
    wait_for(lambda: not node_cluster.node.ctr("tasks", "ls", "-q").stdout.split(), 60,
             f"no container left running (had {len(tasks)})")


def _ours(item: dict) -> bool:
    meta = item["metadata"]
    labels = meta.get("labels") or {}
    return (labels.get("app.kubernetes.io/name") == "agentserving"
            or labels.get("app.kubernetes.io/instance") in (NAME, RELEASE)
            or meta["name"].startswith((f"{NAME}-", f"{RELEASE}-")) or meta["name"] == RELEASE)
