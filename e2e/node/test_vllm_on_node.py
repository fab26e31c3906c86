"""The vLLM example on the same real node, after the reference one is uninstalled:
`helm install` with the vllm-cpu image (docker/vllm-cpu.Dockerfile), `kubectl apply -f
examples/agentserving-vllm-cpu.yaml` (1 prefill + 1 decode pod running real vLLM on the CPU
with LMCache, each with its own KV server beside it: p2p, the decode pod reads the prompt's KV
from the prefill pod's server), and a session through the proxy Service.
"""

from __future__ import annotations

import httpx
import pytest

from agentserving.operator.builders.common import MEMORY_PORT_START, PROXY_PORT
from testkit.servers import wait_until

from ..k8s.cluster import REPO, cache_dir
from .conftest import (
    CHART,
    NAMESPACE,
    OPERATOR_NAMESPACE,
    RELEASE,
    PortForward,
    apply_example,
    client,
    component_of,
    helm,
    three_turns,
)

pytestmark = pytest.mark.timeout(1200)

EXAMPLE = REPO / "examples" / "agentserving-vllm-cpu.yaml"
NAME = "tiny-vllm"
IMAGE = "agentserving/vllm-cpu:0.1.0"


@pytest.fixture(scope="module")
def vllm_deployment(node_cluster, tmp_path_factory, vllm_pace):
    if not (cache_dir() / "images" / "vllm-cpu.tar").exists():
        pytest.fail(f"no vllm-cpu image in {cache_dir() / 'images'}: run `make images`")
    node_cluster.node.wait_images(vllm_pace.bound(600))  # imported beside the earlier tests
    helm(node_cluster, "install", RELEASE, str(CHART), "--namespace", OPERATOR_NAMESPACE,
         "--create-namespace", "--wait", "--timeout", "180s",
         "--set", f"components.vllmImage={IMAGE}")
    try:
        # p2p: no central KV server; each pool pod's kvserver container must be Ready too
        pods = apply_example(node_cluster, EXAMPLE, timeout=vllm_pace.bound(900))
        with PortForward(node_cluster, f"svc/{NAME}-proxy", PROXY_PORT,
                         tmp_path_factory.mktemp("pf") / "vllm-proxy.log") as pf:
            # Ready pods are not yet known pods: the proxy finds each through the kvindex's
            # registry, and until it knows a decode pod it serves every turn whole on the
            # prefill pod (no decode pool)
            wait_until(lambda: (r := httpx.get(pf.url + "/readyz", timeout=5)).status_code
                       == 200 and r.json()["decode_pods"] >= 1, vllm_pace.bound(60),
                       "the proxy to know the decode pod", ignoring=(httpx.HTTPError,),
                       interval_s=0.5)
            yield pods, pf.url
    finally:
        node_cluster.kubectl("delete", "agentserving", NAME, "-n", NAMESPACE,
                             "--timeout=120s", check=False)
        helm(node_cluster, "uninstall", RELEASE, "--namespace", OPERATOR_NAMESPACE, "--wait")


def test_vllm_pods_serve_a_session_with_prefill_decode_disaggregation(vllm_deployment,
                                                                      node_cluster, tmp_path):
    pods, proxy_url = vllm_deployment
    images = {c["image"] for p in pods for c in p["spec"]["containers"]
              if component_of(p) in ("prefill", "decode")}
    assert images == {IMAGE}
    for pod in pods:  # the pod's own KV server beside the worker, in the same image
        if component_of(pod) in ("prefill", "decode"):
            assert [c["name"] for c in pod["spec"]["containers"]] == ["worker", "kvserver"]
    # the first turn goes prefill pod -> decode pod (pulled from the prefill pod's KV server),
    # unless the proxy does not see the prefill pod free yet (just deployed: conditional
    # disaggregation then runs the turn whole on a decode pod, which is no failure): a fresh
    # session then tries again
    for attempt in range(3):
        turns = three_turns(client(proxy_url), f"node-vllm-{attempt}", seed=7 + attempt)
        assert all(resp.choices[0].text for resp, _ in turns)
        first = turns[0][1]
        if first.get("x-agentserving-prefill-pod") == f"{NAME}-prefill-0" and \
                first.get("x-agentserving-decode-pod"):
            break
    assert (first.get("x-agentserving-prefill-pod"), first.get("x-agentserving-decode-pod")) \
        == (f"{NAME}-prefill-0", f"{NAME}-decode-0"), dict(first)
    # point to point: the decode pod's ranks read the prompt's chunks from the prefill pod's
    # own KV server, across the node's pod network (its pull counters, on its memory API)
    with PortForward(node_cluster, f"pod/{NAME}-decode-0", MEMORY_PORT_START,
                     tmp_path / "decode-memory.log") as pf:
        text = httpx.get(pf.url + "/metrics", timeout=10).text
    pulls = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
             if line.startswith("agentserving_kv_handoff_pulls_total{")}
    assert pulls.get('agentserving_kv_handoff_pulls_total{outcome="ok"}', 0) >= 1, pulls
    assert pulls.get('agentserving_kv_handoff_pulls_total{outcome="failed"}', 0) == 0, pulls
